"""`zaya train` with context parallelism on gloo ranks (of the session's pool): cp = 2 (and dp_shard 2 x cp 2)
logs the losses of one process, checkpoints cross between cp sizes both ways, a phase of another cp size moves to
a new mesh at its boundary, and a sequence or world size that does not split stops every rank with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ranks import zaya_train
from runs import write_config
from zaya.config import load_config
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

SECTIONS = dict(
    train={"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "eval_every": 2, "eval_batches": 1},
    optim={"lr": 0.01, "ns_dtype": "float32"},
    schedule={"warmup_steps": 2, "decay_fraction": 0.2, "total_steps": 6},
    checkpoint={"every": 2, "keep": 5},
)
TOLERANCE = 1e-4  # fp32: the sums of the attention and of the gradients run in other orders


def _config(tmp_path: Path, dataset: Path, name: str = "run.toml", **sections) -> Path:
    merged = {key: {**value, **sections.get(key, {})} for key, value in SECTIONS.items()}
    merged.update({key: value for key, value in sections.items() if key not in merged})
    return write_config(tmp_path / name, dataset, **merged)


def _train(config: Path, run_dir: Path, nproc: int, *sets: str) -> tuple[list[int], str, str]:
    """`zaya train` on `nproc` ranks: each rank's exit code, and every rank's output joined."""
    results = zaya_train(config, run_dir, nproc, *sets)
    return [code for code, _, _ in results], "".join(r[1] for r in results), "".join(r[2] for r in results)


def _assert_same_losses(run: Path, reference: Path) -> None:
    rows, expected = read_metrics(run), {r["step"]: r for r in read_metrics(reference)}
    assert rows
    for row in rows:
        theirs = expected[row["step"]]
        assert row["tokens"] == theirs["tokens"]
        assert row["loss"] == pytest.approx(theirs["loss"], rel=TOLERANCE), row["step"]
        if "eval_loss" in theirs:
            assert row["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=TOLERANCE), row["step"]


@pytest.fixture(scope="module")
def single(dataset, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single")
    run = root / "reference"
    build_trainer(load_config(_config(root, dataset, train={"max_steps": 6})), run).run()
    return run


@pytest.mark.parametrize(("nproc", "sets", "mesh"), [
    (2, ["parallel.cp=2"], "dp_shard 1 x cp 2"),
    (4, ["parallel.cp=2", "parallel.cp_kernel=ring"], "dp_shard 2 x cp 2"),
    (4, ["parallel.dp_replicate=2", "parallel.cp=2", "parallel.cp_sharding=contiguous",
         "train.activation_checkpointing=full"], "dp_replicate 2 x dp_shard 1 x cp 2"),
], ids=["cp2", "dp2-cp2-ring", "hsdp2-cp2-contiguous-recompute"])
@pytest.mark.slow
def test_context_parallel_training_logs_the_losses_of_one_process(dataset, tmp_path, single, nproc, sets, mesh):
    codes, out, err = _train(_config(tmp_path, dataset), tmp_path / "run", nproc, *sets)
    assert codes == [0] * len(codes), err[-6000:]
    assert mesh in (tmp_path / "run" / "train.log").read_text()
    _assert_same_losses(tmp_path / "run", single)
    assert out.count("done:") == 1  # rank 0 alone


@pytest.mark.slow
def test_a_checkpoint_continues_at_another_cp_size_and_back(dataset, tmp_path, single):
    config = _config(tmp_path, dataset, train={"max_steps": 2})
    for steps, cp in ((2, 1), (4, 2), (6, 1)):  # written at cp = 1, read at cp = 2; written at cp = 2, read at 1
        codes, _, err = _train(config, tmp_path / "run", 2, f"parallel.cp={cp}", f"train.max_steps={steps}")
        assert codes == [0] * len(codes), err[-6000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("resumed from") == 2 and "dp_shard 1 x cp 2" in log and "dp_shard 2 x cp 1" in log
    _assert_same_losses(tmp_path / "run", single)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_long_context_phase_moves_to_its_cp_size_at_the_boundary(dataset, tmp_path):
    phases = [{"name": "short", "tokens": 2 * 4 * 32, "seq_len": 32},
              {"name": "long", "seq_len": 64, "rope_theta": 1e6, "cp": 2}]
    sections = dict(phases=phases, train={"max_steps": 4, "eval_every": 0}, checkpoint={"every": 2})
    run = tmp_path / "run"
    codes, _, err = _train(_config(tmp_path, dataset, **sections), run, 2)
    assert codes == [0] * len(codes), err[-6000:]
    log = (run / "train.log").read_text()
    assert "phase 'long' runs with cp = 2" in log and "dp_shard 1 x cp 2" in log and "dp_shard 2 x cp 1" in log
    # one process trains the same curriculum with the same losses (its phases carry no cp)
    reference = tmp_path / "reference"
    plain = [{k: v for k, v in phase.items() if k != "cp"} for phase in phases]
    build_trainer(load_config(_config(tmp_path, dataset, "reference.toml", **{**sections, "phases": plain})),
            reference).run()
    _assert_same_losses(run, reference)
    assert [r["phase"] for r in read_metrics(run)] == ["short", "short", "long", "long"]


@pytest.mark.parametrize(("nproc", "sets", "words"), [
    (2, ["parallel.cp=2", "data.seq_len=30"], "key 'data.seq_len' = 30 with parallel.cp = 2"),
    (3, ["parallel.cp=2"], "parallel.cp must divide the world size"),
], ids=["seq-len", "world-size"])
@pytest.mark.slow
def test_a_context_split_that_does_not_fit_stops_every_rank(dataset, tmp_path, nproc, sets, words):
    codes, out, err = _train(_config(tmp_path, dataset), tmp_path / "run", nproc, *sets)
    assert all(code != 0 for code in codes), codes  # every rank stops
    lines = [line for line in (out + err).splitlines() if words in line]
    assert len(lines) == 1, out + err
    assert not (tmp_path / "run" / "checkpoints").exists()
