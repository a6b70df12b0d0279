"""Supervised fine-tuning on chats: a run on a chat dataset learns the assistant tokens only. Its training loss,
its held-out loss and `zaya eval --data` are the cross-entropy of exactly the tokens the loss mask flags."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import zaya
from ranks import zaya_train
from runs import build_chat_dataset, write_config
from zaya.config import load_config
from zaya.data.loader import TokenLoader
from zaya.evals.heldout import evaluate_model
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

SEQ_LEN = 32


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return build_chat_dataset(tmp_path_factory.mktemp("sft"), count=300, val_fraction=0.2)


def _config(path, data, **train):
    return load_config(write_config(path, data, train={"max_steps": 2, "eval_every": 2, "eval_batches": 2, **train},
                                    checkpoint={"every": 2, "keep": 1}))


def _first_batch(config) -> torch.Tensor:
    data = config.data
    with TokenLoader([(data.path, 1.0)], data.seq_len, config.train.seed, block_size=data.block_size,
                     group_blocks=data.group_blocks) as loader:
        return loader.next_batch(config.train.global_batch_size)


@torch.no_grad()
def _cross_entropy(model, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """By hand, from the logits: the next-token cross-entropy of the tokens the batch does not leave out (those
    stored as negative ids, `zaya.data.loss_mask`)."""
    ids = torch.where(batch < 0, -batch - 1, batch)
    targets = torch.where(batch[:, 1:] < 0, torch.full_like(ids[:, 1:], -100), ids[:, 1:])
    logits = model(ids[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)


def test_the_loss_is_the_cross_entropy_of_the_assistant_tokens(chat_data, tmp_path):
    config = _config(tmp_path / "run.toml", chat_data, micro_batch_size=8, global_batch_size=8)
    batch = _first_batch(config)
    assert bool((batch < 0).any()) and bool((batch >= 0).any())
    model = zaya.build_model(config.model.build("test"), seed=config.train.seed)  # the run's first weights
    expected = float(_cross_entropy(model, batch))
    ids = torch.where(batch < 0, -batch - 1, batch)
    with torch.no_grad():
        every_token = float(model.loss(ids[:, :-1], ids[:, 1:]))
    assert abs(expected - every_token) > 0.05
    run = tmp_path / "run"
    build_trainer(config, run).run()
    rows = read_metrics(run)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)

    # the held-out loss (after the last step, whose weights the checkpoint holds) counts the same tokens
    trained = zaya.load_model(run, device="cpu")
    with TokenLoader([(chat_data, 1.0)], SEQ_LEN, seed=0) as loader:
        batches = list(loader.iter_eval_batches(8, max_batches=2))
    assert [r["eval_loss"] for r in rows if "eval_loss" in r][-1] == pytest.approx(
        sum(float(_cross_entropy(trained, b)) for b in batches) / 2, rel=1e-5)
    # zaya eval --data: the mean over every counted token of its batches
    summed = sum(float(_cross_entropy(trained, b, "sum")) for b in batches)
    counted = sum(int((b[:, 1:] >= 0).sum()) for b in batches)
    result = evaluate_model(run, chat_data, seq_len=SEQ_LEN, batch_size=8, max_batches=2, device="cpu")
    assert (result["tokens"], result["loss"]) == (counted, pytest.approx(summed / counted, rel=1e-5))


def test_each_micro_batch_averages_its_own_assistant_tokens(chat_data, tmp_path):
    config = _config(tmp_path / "run.toml", chat_data, micro_batch_size=4, global_batch_size=8,
                     eval_every=0)
    batch = _first_batch(config)
    model = zaya.build_model(config.model.build("test"), seed=config.train.seed)
    halves = [float(_cross_entropy(model, batch[:4])), float(_cross_entropy(model, batch[4:]))]
    build_trainer(config, tmp_path / "run").run()
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(sum(halves) / 2, rel=1e-5)


@pytest.mark.slow
def test_context_parallel_fine_tuning_logs_the_losses_of_one_process(chat_data, tmp_path):
    # each cp rank's loss is its share of the micro-batch's assistant tokens: the shares add up to one process's
    config = write_config(tmp_path / "run.toml", chat_data, checkpoint={"every": 3, "keep": 1}, train={
        "max_steps": 3, "micro_batch_size": 2, "global_batch_size": 4, "eval_every": 3, "eval_batches": 1})
    build_trainer(load_config(config), tmp_path / "single").run()
    assert [code for code, _, _ in zaya_train(config, tmp_path / "cp", 2, "parallel.cp=2")] == [0, 0]
    single, split = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "cp")
    assert len(single) == len(split) == 3
    for a, b in zip(single, split, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert split[-1]["eval_loss"] == pytest.approx(single[-1]["eval_loss"], rel=1e-4)


def _cross_entropy_alone(model, batch: torch.Tensor, eos: int) -> torch.Tensor:
    """By hand: each row cut after every eos, each piece run through the model on its own, the pieces' logits
    side by side; the mean cross-entropy of the tokens the mask keeps."""
    ids = torch.where(batch < 0, -batch - 1, batch)
    targets = torch.where(batch[:, 1:] < 0, torch.full_like(ids[:, 1:], -100), ids[:, 1:])
    logits = []
    with torch.no_grad():
        for row in ids[:, :-1]:
            cuts = [0, *(i + 1 for i in (row[:-1] == eos).nonzero().flatten().tolist()), len(row)]
            logits.append(torch.cat([model(row[None, a:b])[0] for a, b in itertools.pairwise(cuts)]))
    return F.cross_entropy(torch.stack(logits).float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_packed_chats_are_kept_apart_when_the_config_asks(chat_data, tmp_path):
    config = load_config(write_config(
        tmp_path / "run.toml", chat_data, data={"isolate_documents": True, "seq_len": 128},
        checkpoint={"every": 1, "keep": 1}, schedule={"warmup_steps": 0},
        train={"max_steps": 1, "eval_every": 0, "micro_batch_size": 8, "global_batch_size": 8}))
    batch = _first_batch(config)
    with TokenLoader([(chat_data, 1.0)], SEQ_LEN, seed=0) as loader:
        eos = loader.datasets[0].eos_id
    assert int((batch == ~eos).sum()) >= 8  # rows of several chats
    model = zaya.build_model(config.model.build("test"), seed=config.train.seed)
    expected = float(_cross_entropy_alone(model, batch, eos))
    assert abs(expected - float(_cross_entropy(model, batch))) > 1e-3  # packed without isolation differs
    build_trainer(config, tmp_path / "run").run()
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(expected, rel=1e-5)


def _isolated_config(path, data):
    # chats of ~70 tokens in rows of 128: documents cross chunk and rank boundaries, rows end mid-chat
    train = {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4, "eval_every": 2, "eval_batches": 1}
    return write_config(path, data, data={"isolate_documents": True, "seq_len": 128},
                        checkpoint={"every": 2, "keep": 1}, train=train)


@pytest.fixture(scope="module")
def isolated_single(chat_data, tmp_path_factory):
    """The losses of one process keeping the chats apart."""
    root = tmp_path_factory.mktemp("isolated")
    build_trainer(load_config(_isolated_config(root / "run.toml", chat_data)), root / "single").run()
    return read_metrics(root / "single")


@pytest.mark.slow
@pytest.mark.parametrize("sets", [
    ["parallel.cp=2"],  # 2 x 8 chunks of 8 tokens, dealt out by attention work
    ["parallel.cp=2", "parallel.cp_document_chunks=2", "parallel.cp_kernel=ring"],  # head-tail's pairs of 32
], ids=["balanced-allgather", "headtail-ring"])
def test_kept_apart_chats_split_over_context_parallel_ranks_log_the_losses_of_one_process(chat_data, tmp_path,
                                                                                        isolated_single, sets):
    results = zaya_train(_isolated_config(tmp_path / "run.toml", chat_data), tmp_path / "cp", 2, *sets)
    assert [code for code, _, _ in results] == [0, 0], "".join(err for _, _, err in results)[-4000:]
    assert "dp_shard 1 x cp 2" in (tmp_path / "cp" / "train.log").read_text()
    split = read_metrics(tmp_path / "cp")
    assert [r["step"] for r in split] == [1, 2]
    for a, b in zip(isolated_single, split, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert split[-1]["eval_loss"] == pytest.approx(isolated_single[-1]["eval_loss"], rel=1e-5)


def test_kept_apart_documents_split_over_context_parallel_ranks_into_chunks_that_fit(chat_data, tmp_path):
    path = write_config(tmp_path / "run.toml", chat_data, data={"isolate_documents": True, "seq_len": 64},
                        parallel={"cp": 2})
    assert load_config(path).resolved_phases()[0].cp == 2  # no longer refused
    with pytest.raises(zaya.ZayaError, match=r"^--set parallel.cp_document_chunks=6: key 'data.seq_len' = 64 with "
                                             r"parallel.cp = 2 and parallel.cp_document_chunks = 6 \(phase 'main' "
                                             r"keeps documents apart\): a sequence of 64 tokens does not split"):
        load_config(path, ["parallel.cp_document_chunks=6"])
    with pytest.raises(zaya.ZayaError, match=r"shorter than the 2 tokens the convolutions reach back"):
        load_config(path, ["parallel.cp_document_chunks=32"])  # 64 chunks of 1 token
