"""Sharded training under torchrun on gloo: FSDP2 and HSDP train like one process, checkpoints written by every
rank load on other world sizes and meshes, async saves hold their step's values, two torchrun agents form one
job that survives a killed rank, and bad input stops every rank at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zaya
from ranks import free_port, run_command, torchrun
from runs import write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

pytestmark = pytest.mark.slow

# fp32 everywhere, the Newton-Schulz iteration included: what is left between world sizes is the order of
# fp32 reductions (micro-batches, reduce-scatter, the norms of the clip)
SECTIONS = dict(
    train={"max_steps": 5, "micro_batch_size": 2, "global_batch_size": 12, "eval_every": 0},
    optim={"lr": 0.01, "ns_dtype": "float32"},
    schedule={"warmup_steps": 2, "decay_fraction": 0.2, "total_steps": 8},
    checkpoint={"every": 5, "keep": 3},
)
TOLERANCE = 1e-5
# a run that changes world size mid-way has summed in more orders than one that did not: after 6 steps its
# parameters moved up to 1.03e-5 (relative) from one process's on 1 -> 3 and 2 -> 3
RESHARD_TOLERANCE = 5e-5
# Some small tensors are ill-conditioned in fp32: one process with 4 samples per micro-batch instead of 2 ends
# 5.9e-5 (relative) from itself in the 192 weights of blocks.1.attn.conv0_weight, 94% of it in one element whose
# AdamW update divides near-cancelling moments. Such a tensor may differ from one process by ORDER_FACTOR times
# what one process differs from itself under another order of sums; a sharding bug moves weights by far more.
ORDER_FACTOR = 3.0


def _config(tmp_path: Path, dataset: Path, name: str = "run.toml", **sections) -> Path:
    merged = {key: {**value, **sections.get(key, {})} for key, value in SECTIONS.items()}
    merged.update({key: value for key, value in sections.items() if key not in merged})
    return write_config(tmp_path / name, dataset, **merged)


def _train(config: Path, run_dir: Path, nproc: int, *sets: str, env: dict | None = None):
    args = ["train", str(config), "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]
    result = torchrun(*args, nproc=nproc, env=env, timeout=400)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_same_training(run: Path, reference: Path, tolerance: float = TOLERANCE) -> None:
    """Every step of `run` as `reference` (one process, a checkpoint at every step) has it: the batches and
    the loss (within TOLERANCE), and the final parameters (within `tolerance`, or ORDER_FACTOR times the gap
    between `reference` and its twin that sums in another order, whichever is larger)."""
    rows = read_metrics(run)
    expected = {r["step"]: r for r in read_metrics(reference)}
    for row in rows:
        assert row["batch_size"] == expected[row["step"]]["batch_size"]
        assert row["tokens"] == expected[row["step"]]["tokens"]  # the same samples consumed
        assert row["loss"] == pytest.approx(expected[row["step"]]["loss"], rel=TOLERANCE), row["step"]
    last = f"step_{rows[-1]['step']:08d}"
    ours = zaya.load_model(run).state_dict()
    theirs = zaya.load_model(reference / "checkpoints" / last).state_dict()
    twin = zaya.load_model(reference.with_name(reference.name + "-twin") / "checkpoints" / last).state_dict()
    assert set(ours) == set(theirs)
    for name in theirs:
        bound = max(tolerance, ORDER_FACTOR * _relative(twin[name], theirs[name]))
        assert _relative(ours[name], theirs[name]) <= bound, name


def _reference(root: Path, dataset: Path, **sections) -> Path:
    """The run in one process, 6 steps, a checkpoint after each; beside it its twin, the same run with 4 samples
    per micro-batch instead of 2, which sums the same gradients in another order."""
    run = root / "reference"
    for name, micro_batch in (("reference", 2), ("reference-twin", 4)):
        steps = {**sections, "train": {"max_steps": 6, "micro_batch_size": micro_batch},
                 "checkpoint": {"every": 1, "keep": 10}}
        build_trainer(load_config(_config(root, dataset, f"{name}.toml", **steps)), root / name).run()
    return run


@pytest.fixture(scope="module")
def single(dataset, tmp_path_factory) -> Path:
    """The reference: the same run in one process."""
    return _reference(tmp_path_factory.mktemp("single"), dataset)


@pytest.mark.parametrize(("nproc", "mesh"), [(2, []), (3, []), (4, ["parallel.dp_replicate=2"])],
                         ids=["fsdp2", "fsdp3-uneven", "hsdp2x2"])
def test_sharded_training_equals_one_process(dataset, tmp_path, single, nproc, mesh):
    run = tmp_path / "run"
    _train(_config(tmp_path, dataset), run, nproc, *mesh)
    _assert_same_training(run, single)
    rows = read_metrics(run)
    assert all(len(r["peak_memory_bytes"]) == nproc and min(r["comm_bytes"]) > 0 for r in rows)
    log = (run / "train.log").read_text()
    shape = "dp_replicate 2 x dp_shard 2" if mesh else f"dp_replicate 1 x dp_shard {nproc}"
    assert shape in log and "timeouts: collectives 1800 s" in log
    # rank 0 writes train.log and the metrics, every other rank a log of its own
    assert sorted(p.name for p in (run / "logs").iterdir()) == [f"rank-{r}.log" for r in range(1, nproc)]


def _shards_by_rank(directory: Path) -> dict[int, int]:
    return {int(re.match(r"__(\d+)_", p.name).group(1)): p.stat().st_size for p in directory.glob("*.distcp")}


def test_a_two_rank_checkpoint_holds_each_ranks_shards(dataset, tmp_path):
    _train(_config(tmp_path, dataset, train={"max_steps": 2}, checkpoint={"every": 2}), tmp_path / "run", 2)
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    shards = _shards_by_rank(step)
    # both ranks wrote their own halves of the tensors, of about the same size
    assert set(shards) == {0, 1} and min(shards.values()) > 0.4 * max(shards.values())
    metadata = ckpt.read_metadata(step)
    for key in ("model.blocks.0.attn.q_proj.weight", "model.blocks.0.moe.experts.gate_up_proj",
                "optim..state.blocks.0.moe.experts.down_proj.momentum_buffer"):
        assert len(metadata.state_dict_metadata[key].chunks) == 2, key  # one piece per rank


# 2 experts whose gate/up rows (96) split evenly over 3 ranks: those stacks are split along their rows
ROW_SPLIT_EXPERTS = {"preset": "micro", "temp_init": 1.0, "num_experts": 2, "moe_intermediate_size": 48}


@pytest.mark.parametrize(("before", "after", "model"), [(2, 1, {}), (2, 3, {}), (1, 3, {}), (3, 2, ROW_SPLIT_EXPERTS)],
                         ids=["2-1", "2-3", "1-3", "3-2-row-split-experts"])
def test_a_checkpoint_continues_on_another_world_size(dataset, tmp_path, single, before, after, model):
    config = _config(tmp_path, dataset, train={"max_steps": 3}, checkpoint={"every": 3}, model=model)
    _train(config, tmp_path / "run", before)
    if model:
        chunks = ckpt.read_metadata(tmp_path / "run" / "checkpoints" / "step_00000003").state_dict_metadata[
            "model.blocks.0.moe.experts.gate_up_proj"].chunks
        assert sorted(c.offsets[1] for c in chunks) == [0, 32, 64]  # split along the rows of each expert
    _train(config, tmp_path / "run", after, "train.max_steps=6")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resumed from" in log and f"written by {before} rank(s)" in log
    # on another world size the run sees the same batches; what differs is the order of fp32 sums
    reference = _reference(tmp_path, dataset, model=model) if model else single
    _assert_same_training(tmp_path / "run", reference, RESHARD_TOLERANCE)
    ours = ckpt.read_json(tmp_path / "run" / "checkpoints" / "step_00000006" / ckpt.TRAIN_STATE_FILE)
    theirs = ckpt.read_json(reference / "checkpoints" / "step_00000006" / ckpt.TRAIN_STATE_FILE)
    assert ours["state"]["loaders"] == theirs["state"]["loaders"]  # consumed samples carried over exactly


def test_an_hsdp_checkpoint_continues_as_fsdp_and_converts_to_hf(dataset, tmp_path, single):
    config = _config(tmp_path, dataset, train={"max_steps": 3}, checkpoint={"every": 3})
    _train(config, tmp_path / "run", 4, "parallel.dp_replicate=2")
    _train(config, tmp_path / "run", 2, "train.max_steps=5")
    _assert_same_training(tmp_path / "run", single, RESHARD_TOLERANCE)

    from transformers import AutoModelForCausalLM

    result = run_command([sys.executable, "-m", "zaya.cli", "convert", tmp_path / "run", tmp_path / "hf"], timeout=120)
    assert result.returncode == 0, result.stderr
    ours = zaya.load_model(tmp_path / "run", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[2, 17, 5, 99, 41, 3, 8]])
    with torch.no_grad():
        assert _relative(theirs(ids).logits, ours(ids)) <= 1e-5


def test_async_saves_hold_the_values_of_their_step(dataset, tmp_path):
    sections = dict(train={"max_steps": 6}, checkpoint={"every": 2, "keep": 3})
    _train(_config(tmp_path, dataset, **sections), tmp_path / "sync", 2)
    _train(_config(tmp_path, dataset, **sections), tmp_path / "async", 2, "checkpoint.async_save=true")
    for step in (2, 4, 6):
        name = f"step_{step:08d}"
        a = _load_all(tmp_path / "sync" / "checkpoints" / name)
        b = _load_all(tmp_path / "async" / "checkpoints" / name)
        assert a.keys() == b.keys()
        for key in a:  # training went on while the async save wrote; it holds its own step's values
            assert torch.equal(a[key], b[key]), (step, key)


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, read in this one process."""
    metadata = ckpt.read_metadata(directory)
    flat = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    nested: dict = {}
    for key, tensor in flat.items():
        top, rest = key.split(".", 1)
        nested.setdefault(top, {})[rest] = tensor
    ckpt.load_tensors(directory, nested)
    return flat


def test_two_torchrun_agents_form_one_job_that_survives_a_killed_rank(dataset, tmp_path, single):
    """Two "nodes" of two ranks each, HSDP across them; rank 3 is killed before step 4 of the first attempt,
    torchrun restarts the job, and it resumes from the checkpoint of step 3."""
    config = _config(tmp_path, dataset, checkpoint={"every": 3})
    run = tmp_path / "run"
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zaya-test",
               "--max-restarts=1", "--monitor-interval=0.5", "-m", "zaya.cli", "train", str(config),
               "--run-dir", str(run), "--set", "parallel.dp_replicate=2", "--set", "parallel.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_FAULTS": "sigkill@step:4@rank=3@attempt=0"}
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=400))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-6000:]
    log = (run / "train.log").read_text()
    assert "resumed from" in log and "step_00000003" in log
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    _assert_same_training(run, single)


@pytest.mark.parametrize(("sets", "key"), [
    (["train.global_batch_size=9", "train.micro_batch_size=3"], "train.global_batch_size"),
    (["parallel.dp_replicate=2", "parallel.dp_shard=3"], "parallel.dp_replicate x dp_shard x cp"),
    (["parallel.cp_kernel=tree"], "parallel.cp_kernel"),
    (["parallel.backend=mpi"], "parallel.backend"),
], ids=["batch", "mesh", "cp", "backend"])
def test_bad_input_stops_every_rank_with_one_line(dataset, tmp_path, sets, key):
    args = ["train", str(_config(tmp_path, dataset)), "--run-dir", str(tmp_path / "run")]
    result = torchrun(*args, *(a for s in sets for a in ("--set", s)), nproc=2, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("zaya: error")]
    assert len(errors) == 1 and key in errors[0], result.stderr[-3000:]
    # torchrun's summary of its workers: both failed (it stops the other once the first one has exited)
    exits = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+)", result.stderr))
    assert set(exits) == {"0", "1"} and "0" not in exits.values(), result.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_old_timeout_key_says_where_it_went(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"collective_timeout_s": 60.0})
    with pytest.raises(ZayaError, match=r"'train.collective_timeout_s' moved to 'parallel.timeout_s'"):
        load_config(config)

