"""What can be known at a run's start stops it there: a val split that cannot fill one evaluation batch, a plan that
does not fit the device's memory, sequences longer than the model's positions; `zaya eval --data` likewise."""

from __future__ import annotations

import dataclasses
import resource

import pytest

import zaya
from runs import build_chat_dataset, write_config
from zaya.config import load_config
from zaya.data.dataset_reader import open_dataset
from zaya.errors import ZayaError
from zaya.parallel.launch import Launch
from zaya.train.preflight import check_eval_splits
from zaya.training import TrainingJob, build_trainer


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """40 chats built with --val-fraction 0.01: a val split of 0 tokens."""
    return build_chat_dataset(tmp_path_factory.mktemp("chats"), count=40, val_fraction=0.01)


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_an_empty_val_split_is_refused_before_the_first_step(chats, tmp_path, cli):
    assert open_dataset(chats).entries["val"].num_tokens == 0
    config = write_config(tmp_path / "run.toml", chats)
    run = tmp_path / "run"
    code, _, err = cli("train", config, "--run-dir", run)
    line = _error_line(err)
    assert code == 2 and line.startswith(f"zaya: error: {chats}: the val split has 0 tokens"), line
    assert "one evaluation batch of 8 windows (257 tokens)" in line  # global_batch_size 8, seq_len 32
    assert "a larger --val-fraction" in line and "train.eval_every = 0" in line
    assert not run.exists()  # refused before anything was written
    # without evaluations the same data trains: the refusal is about them alone
    job = TrainingJob.check(load_config(config, ["train.eval_every=0"]), run, launch=Launch(), environ={})
    job.lock.release()


def test_the_val_split_must_hold_one_global_batch_of_windows(dataset, tmp_path):
    tokens = open_dataset(dataset).entries["val"].num_tokens
    windows = (tokens - 1) // 32
    config = write_config(tmp_path / "run.toml", dataset, train={"micro_batch_size": 1, "global_batch_size": windows})
    check_eval_splits(load_config(config).resolve(1, "fp32"))  # exactly one batch: it evaluates
    more = load_config(config, [f"train.global_batch_size={windows + 1}"]).resolve(1, "fp32")
    with pytest.raises(ZayaError) as error:
        check_eval_splits(more)
    assert f"the val split has {tokens:,} tokens ({windows:,} windows of seq_len + 1 = 33 tokens), fewer than one " \
           f"evaluation batch of {windows + 1:,} windows" in str(error.value)
    check_eval_splits(load_config(config, [f"train.global_batch_size={windows + 1}", "train.eval_every=0"]).resolve(
        1, "fp32"))  # a run that does not evaluate needs no val split


def test_eval_data_refuses_a_split_too_small_before_the_first_batch(chats, tmp_path, cli):
    model = tmp_path / "hf"  # a model that knows the data's tokenizer
    zaya.export_hf(zaya.build_model(zaya.get_preset("micro", vocab_size=384)), model,
                   tokenizer=chats / "tokenizer.json")
    code, out, err = cli("eval", "--model", model, "--data", chats, "--seq-len", "32")
    line = _error_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"zaya: error: {chats}: the val split has 0 tokens") and "--val-fraction" in line, line
    code, _, err = cli("eval", "--model", model, "--data", chats, "--split", "train", "--seq-len", "1024")
    line = _error_line(err)  # 2,942 tokens: two windows of 1,025, not eight
    assert "the train split has 2,942 tokens (2 windows" in line and "--val-fraction" not in line, line
    assert "a smaller --batch-size or --seq-len" in line


# a micro-batch of 64 sequences of 16M tokens: tens of terabytes of activations by the plan, on any machine
HUGE = ["model.max_position_embeddings=16777216", "data.seq_len=16777216", "train.micro_batch_size=64",
        "train.global_batch_size=64", "train.eval_every=0"]


def test_a_run_the_plan_says_does_not_fit_stops_before_it_allocates(dataset, tmp_path, cli):
    config = write_config(tmp_path / "run.toml", dataset)
    run = tmp_path / "run"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, _, err = cli("train", config, "--run-dir", run, *(f"--set={s}" for s in HUGE))
    line = _error_line(err)
    assert code == 2 and f"zaya: error: {config}: the plan needs" in line, line
    assert "GB per CPU process (the largest part: activations" in line and "GB available to it" in line
    assert line.endswith("; or pass --allow-over-memory to start anyway")
    assert not run.exists()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2 * 2**20  # KiB: nothing was allocated


def test_allow_over_memory_starts_anyway_and_the_log_says_so(dataset, tmp_path, monkeypatch):
    # a host with 1 MB available: the micro model does not fit (the plan's figure, not the machine's, decides)
    monkeypatch.setattr("zaya.plan.forecast.memory_available_bytes", lambda device: 10**6)
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"eval_every": 0}))
    run = tmp_path / "run"
    with pytest.raises(ZayaError, match=r"more than the 0\.00 GB available to it; .* or pass --allow-over-memory"):
        build_trainer(config, run)
    trainer = build_trainer(config, run, allow_over_memory=True)
    trainer.setup.lock.release()  # not run: what it logs at its start are these notes
    assert any("the plan needs" in note and note.endswith("starting anyway (--allow-over-memory)")
               for note in trainer.setup.notes)


def test_the_cpu_processes_of_a_node_share_its_memory(dataset, tmp_path, monkeypatch):
    import torch

    from zaya.plan.forecast import Forecast

    monkeypatch.setattr("zaya.plan.forecast.memory_available_bytes", lambda device: 8 * 10**9)
    run = load_config(write_config(tmp_path / "run.toml", dataset)).resolve(2, "fp32")
    forecast = Forecast.for_run(run, torch.device("cpu"), 2, tmp_path / "no-table.json")
    assert forecast.plan.device.memory_bytes == 4 * 10**9 and forecast.plan.device.host
    assert "GB per CPU process" in forecast.start(0) and "of 4.0 GB available" in forecast.start(0)


def test_sequences_longer_than_the_positions_are_refused_in_a_config_made_in_code(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset))
    longer = dataclasses.replace(config, data=dataclasses.replace(config.data, seq_len=8192))
    with pytest.raises(ZayaError, match=r"key 'data.seq_len' = 8,192 is longer than model.max_position_embeddings = "
                                        r"4,096"):
        longer.resolve(1, "fp32")
