"""Sharded training on gloo ranks (`zaya train` on the ranks of the session's pool): FSDP2, HSDP and expert
parallelism train like one process, and a checkpoint written by every rank continues on another world size, mesh
and expert layout (a chain: 2 ranks with ep 2 -> 3 ranks with uneven shards -> HSDP 2 x 2 with ep 2 -> ep 4 -> cp
2 x ep 2, then a Hugging Face export; and 3 -> 2 with experts split along their rows); compiled blocks with cp and
ep, whose async saves hold their step's values; under torchrun, two agents form one job that survives a killed rank,
and bad input stops every rank with one line."""

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
from ranks import (
    free_port,
    run_command,
    run_distributed,
    torchrun,
    train_args,
    zaya_compiled_on_rank,
    zaya_on_rank,
    zaya_train,
)
from runs import write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.optim.config import OptimConfig
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

# fp32 everywhere, the Newton-Schulz iteration included: what is left between world sizes is the order of
# fp32 reductions (micro-batches, reduce-scatter, the norms of the clip)
SECTIONS = dict(
    train={"max_steps": 10, "micro_batch_size": 2, "global_batch_size": 12, "eval_every": 0},
    optim={"lr": 0.01, "ns_dtype": "float32"},
    schedule={"warmup_steps": 2, "decay_fraction": 0.2, "total_steps": 16},
    checkpoint={"every": 2, "keep": 10},
)
LOSS_TOLERANCE = 1e-5
# a run that changes world size mid-way has summed in more orders than one that did not: after 6 steps its
# parameters moved up to 1.03e-5 (relative) from one process's on 1 -> 3 and 2 -> 3, and up to 1.9e-5 on 3
# ranks from the start (on an Intel Xeon's BLAS); since the model draws its initial values once per tensor
# (`Zaya.initializers`), the two-expert model of the row-split test moves up to 5.1e-5 on 3 -> 2 ranks in its
# convolutions' small weights (its twin 1.1e-5), on a Zen 3 EPYC, and 1.2e-4 since the vectors train at
# `optim.vector_lr_ratio` of AdamW's rate; a sharding bug moves a tensor by far more (order 1)
TOLERANCE = 2e-4
# Some small tensors are ill-conditioned in fp32: one process with 4 samples per micro-batch instead of 2 ends
# 5.9e-5 (relative) from itself in the 192 weights of blocks.1.attn.conv0_weight, 94% of it in one element whose
# AdamW update divides near-cancelling moments. Such a tensor may differ from one process by ORDER_FACTOR times
# what one process differs from itself under another order of sums; a sharding bug moves weights by far more.
ORDER_FACTOR = 3.0


def _config(tmp_path: Path, dataset: Path, name: str = "run.toml", **sections) -> Path:
    merged = {key: {**value, **sections.get(key, {})} for key, value in SECTIONS.items()}
    merged.update({key: value for key, value in sections.items() if key not in merged})
    return write_config(tmp_path / name, dataset, **merged)


def _train(config: Path, run_dir: Path, nproc: int, *sets: str) -> list[tuple[int, str, str]]:
    """`zaya train` on `nproc` ranks; every rank must succeed."""
    results = zaya_train(config, run_dir, nproc, *sets)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-6000:]}"
    return results


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """||a - b|| / ||b||, with ||b|| taken as at least `floor`."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


# The vectors move by up to one AdamW step of their rate (lr x optim.vector_lr_ratio) per element and step; a
# tensor that has moved from zero by a few such steps (a router bias: 1e-4 to 5e-4 after 4 steps) is compared
# against the size it could have reached, so that its reduction-order error is not read as a relative error of
# its tiny values
VECTOR_STEP = SECTIONS["optim"]["lr"] * OptimConfig().vector_lr_ratio


def _assert_same_training(run: Path, reference: Path, steps: range) -> None:
    """Steps `steps` of `run` as `reference` (one process, a checkpoint at every step) has them: the batches and
    the loss, and the parameters after the last (within TOLERANCE, or ORDER_FACTOR times the gap between
    `reference` and its twin that sums in another order, whichever is larger)."""
    rows = {row["step"]: row for row in read_metrics(run)}
    expected = {row["step"]: row for row in read_metrics(reference)}
    for step in steps:
        row = rows[step]
        assert row["batch_size"] == expected[step]["batch_size"]
        assert row["tokens"] == expected[step]["tokens"]  # the same samples consumed
        assert row["loss"] == pytest.approx(expected[step]["loss"], rel=LOSS_TOLERANCE), step
    last = f"step_{steps[-1]:08d}"
    ours = zaya.load_model(run / "checkpoints" / last).state_dict()
    theirs = zaya.load_model(reference / "checkpoints" / last).state_dict()
    twin = zaya.load_model(reference.with_name(reference.name + "-twin") / "checkpoints" / last).state_dict()
    assert set(ours) == set(theirs)
    for name in theirs:
        floor = VECTOR_STEP * steps[-1] * theirs[name].numel() ** 0.5
        bound = max(TOLERANCE, ORDER_FACTOR * _relative(twin[name], theirs[name], floor))
        assert _relative(ours[name], theirs[name], floor) <= bound, name
    ours_state = ckpt.read_json(run / "checkpoints" / last / ckpt.TRAIN_STATE_FILE)["state"]
    theirs_state = ckpt.read_json(reference / "checkpoints" / last / ckpt.TRAIN_STATE_FILE)["state"]
    assert ours_state["loaders"] == theirs_state["loaders"]  # consumed samples carried over exactly


def _reference(root: Path, dataset: Path, steps: int, **sections) -> Path:
    """The run in one process, a checkpoint after every other step (where the runs compared with it end); beside
    it its twin, the same run with 4 samples per micro-batch instead of 2, which sums the same gradients in
    another order."""
    for name, micro_batch in (("reference", 2), ("reference-twin", 4)):
        changed = {**sections, "train": {"max_steps": steps, "micro_batch_size": micro_batch},
                   "checkpoint": {"every": 2, "keep": 20}}
        build_trainer(load_config(_config(root, dataset, f"{name}.toml", **changed)), root / name).run()
    return root / "reference"


@pytest.fixture(scope="module")
def single(dataset, tmp_path_factory) -> Path:
    """The reference: the same run in one process."""
    return _reference(tmp_path_factory.mktemp("single"), dataset, 10)


def _shards_by_rank(directory: Path) -> dict[int, int]:
    return {int(re.match(r"__(\d+)_", p.name).group(1)): p.stat().st_size for p in directory.glob("*.distcp")}


@pytest.mark.slow
def test_a_checkpoint_chain_across_world_sizes_and_meshes_trains_like_one_process(dataset, tmp_path, single):
    """Every link of a chain of checkpoints trains two steps as one process does: 2 ranks with the experts split
    over them (ep 2) in ZAYA1's ZeRO-1 from the start (whole parameters kept on every rank and gathered again
    after each update, the optimizer state and Newton-Schulz sharded) -> ZeRO-1 on 3 ranks with uneven shards ->
    HSDP 2 x 2 with ep 2, ZeRO-2 -> ep 4 with the MoE recomputed in backward -> cp 2 x ep 2 (each expert stack
    sharded over the 2 ranks that hold it); then a Hugging Face export. Each sharding mode and expert layout
    resumes in the others (ZeRO-2 saves and loads the sharded parameters as full sharding does), and the
    experts are saved whole, keyed by expert, at every ep."""
    config, run = _config(tmp_path, dataset), tmp_path / "run"
    chain = [(2, ["parallel.ep=2", "parallel.sharding=zero1"],
              "zero1 sharding; mesh dp_replicate 1 x dp_shard 2 x cp 1 (experts over ep 2)"),
             (3, ["parallel.sharding=zero1"], "zero1 sharding; mesh dp_replicate 1 x dp_shard 3 x cp 1 ="),
             (4, ["parallel.dp_replicate=2", "parallel.ep=2", "parallel.sharding=zero2"],
              "zero2 sharding; mesh dp_replicate 2 x dp_shard 2 x cp 1 (experts over ep 2)"),
             (4, ["parallel.ep=4", "train.activation_checkpointing=moe"],
              "full sharding; mesh dp_replicate 1 x dp_shard 4 x cp 1 (experts over ep 4)"),
             (4, ["parallel.cp=2", "parallel.ep=2"], "mesh dp_replicate 1 x dp_shard 2 x cp 2 (experts over ep 2)")]
    written = None
    for index, (nproc, mesh, shape) in enumerate(chain):
        steps = 2 * (index + 1)
        results = _train(config, run, nproc, *mesh, f"train.max_steps={steps}")
        segment = (run / "train.log").read_text().split("resumed from")[-1]  # this run's lines
        assert shape in segment, segment
        assert written is None or f"written by {written} rank(s)" in segment, segment
        assert "timeouts: collectives 1800 s" in segment
        assert sum(out.count("done:") for _, out, _ in results) == 1  # rank 0 alone says it
        rows = [r for r in read_metrics(run) if r["step"] > steps - 2]
        assert all(len(r["peak_memory_bytes"]) == nproc and min(r["comm_bytes"]) > 0 for r in rows)
        _assert_same_training(run, single, range(steps - 1, steps + 1))
        metadata = ckpt.read_metadata(run / "checkpoints" / f"step_{steps:08d}")
        for key in ("model.blocks.0.moe.experts.gate_up_proj",
                    "optim..state.blocks.0.moe.experts.down_proj.momentum_buffer"):
            assert metadata.state_dict_metadata[key].size[0] == 4, key  # whole, keyed by expert
        written = nproc
    # rank 0 writes train.log and the metrics, every other rank a log of its own
    assert sorted(p.name for p in (run / "logs").iterdir()) == [f"rank-{r}.log" for r in range(1, 4)]
    # the HSDP checkpoint of step 6 holds each shard rank's part of every tensor, once (the experts: each ep
    # rank's)
    metadata = ckpt.read_metadata(run / "checkpoints" / "step_00000006")
    for key in ("model.blocks.0.attn.q_proj.weight", "model.blocks.0.moe.experts.gate_up_proj",
                "optim..state.blocks.0.moe.experts.down_proj.momentum_buffer"):
        assert len(metadata.state_dict_metadata[key].chunks) == 2, key
    shards = _shards_by_rank(run / "checkpoints" / "step_00000004")
    assert set(shards) == {0, 1, 2} and min(shards.values()) > 0.4 * max(shards.values())
    _assert_same_training(run, single, range(1, 11))

    from transformers import AutoModelForCausalLM

    result = run_command([sys.executable, "-m", "zaya.cli", "convert", run, tmp_path / "hf"], timeout=120)
    assert result.returncode == 0, result.stderr
    ours = zaya.load_model(run, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[2, 17, 5, 99, 41, 3, 8]])
    with torch.no_grad():
        assert _relative(theirs(ids).logits, ours(ids)) <= 1e-5


# 2 experts whose gate/up rows (96) split evenly over 3 ranks: those stacks are split along their rows
ROW_SPLIT_EXPERTS = {"preset": "micro", "temp_init": 1.0, "num_experts": 2, "moe_intermediate_size": 48}


@pytest.mark.slow
def test_experts_split_along_their_rows_continue_on_another_world_size(dataset, tmp_path):
    reference = _reference(tmp_path, dataset, 4, model=ROW_SPLIT_EXPERTS)
    config, run = _config(tmp_path, dataset, model=ROW_SPLIT_EXPERTS), tmp_path / "run"
    _train(config, run, 3, "train.max_steps=2")
    chunks = ckpt.read_metadata(run / "checkpoints" / "step_00000002").state_dict_metadata[
        "model.blocks.0.moe.experts.gate_up_proj"].chunks
    assert sorted(c.offsets[1] for c in chunks) == [0, 32, 64]  # split along the rows of each expert
    _train(config, run, 2, "train.max_steps=4")
    assert "written by 3 rank(s)" in (run / "train.log").read_text()
    _assert_same_training(run, reference, range(1, 5))


@pytest.mark.slow
def test_two_torchrun_agents_form_one_job_that_survives_a_killed_rank(dataset, tmp_path, single):
    """Two "nodes" of one rank each, HSDP across them; rank 1 is killed before step 4 of the first attempt,
    torchrun restarts the job, and it resumes from the checkpoint of step 3. Torchrun may restart the healthy
    agent's workers without counting a restart, so the two agents' restart counts can differ; the ranks still
    meet on the second attempt's own store (tests/parallel/test_launch.py), within seconds, not after
    `parallel.init_timeout_s`."""
    config = _config(tmp_path, dataset, train={"max_steps": 6}, checkpoint={"every": 3})
    run = tmp_path / "run"
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zaya-test",
               "--max-restarts=1", "--monitor-interval=0.5", "-m", "zaya.cli", "train", str(config),
               "--run-dir", str(run), "--set", "parallel.dp_replicate=2", "--set", "parallel.timeout_s=60",
               "--set", "parallel.init_timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_FAULTS": "sigkill@step:4@rank=1@attempt=0"}
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
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    _assert_same_training(run, single, range(1, 7))


@pytest.mark.slow
def test_bad_input_stops_every_rank_with_one_line_under_torchrun(dataset, tmp_path):
    args = ["train", str(_config(tmp_path, dataset)), "--run-dir", str(tmp_path / "run"),
            "--set", "train.global_batch_size=9", "--set", "train.micro_batch_size=3"]
    result = torchrun(*args, nproc=2, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("zaya: error")]
    assert len(errors) == 1 and "train.global_batch_size" in errors[0], result.stderr[-3000:]
    # torchrun's summary of its workers: both failed (it stops the other once the first one has exited)
    exits = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+)", result.stderr))
    assert set(exits) == {"0", "1"} and "0" not in exits.values(), result.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize(("sets", "key"), [
    (["parallel.dp_replicate=2", "parallel.dp_shard=3"], "parallel.dp_replicate x dp_shard x cp"),
    (["parallel.cp_kernel=tree"], "parallel.cp_kernel"),
    (["parallel.backend=mpi"], "parallel.backend"),
    (["parallel.backend=nccl"], "parallel.backend' is 'nccl', which needs GPUs"),
    (["parallel.ep=3"], "parallel.ep = 3 does not divide parallel.dp_shard x cp = 2 x 1"),
], ids=["mesh", "cp", "backend", "nccl-on-cpu", "ep"])
@pytest.mark.slow
def test_bad_input_on_every_rank_is_one_line_from_rank_0(dataset, tmp_path, sets, key):
    results = zaya_train(_config(tmp_path, dataset), tmp_path / "run", 2, *sets, timeout=120)
    assert all(code == 2 for code, _, _ in results)
    errors = [line for _, _, err in results for line in err.splitlines() if line.startswith("zaya: error")]
    assert len(errors) == 1 and key in errors[0] and "(rank" not in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_the_old_timeout_key_says_where_it_went(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"collective_timeout_s": 60.0})
    with pytest.raises(ZayaError, match=r"'train.collective_timeout_s' moved to 'parallel.timeout_s'"):
        load_config(config)


def test_experts_that_do_not_split_over_ep_are_one_line(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, model={"num_experts": 6}), ["parallel.ep=4"])
    with pytest.raises(ZayaError, match=r"key 'parallel\.ep': 6 experts do not split into parallel\.ep = 4 equal"):
        config.resolve(4).check_job()


@pytest.mark.slow
def test_compiled_blocks_with_context_and_expert_parallelism_train_like_one_process(dataset, tmp_path, single):
    """cp 2 x ep 2 on 2 ranks, compiled (through `aot_eager`). A block compiles around its experts (an FSDP unit
    of their own, whose hooks no graph holds): each sublayer is a full graph but attention, which breaks where
    the sequence's exchanges run eagerly, and the experts' forward is one, the token exchange included (its
    split sizes enter the graph as sizes it cannot know). The checkpoints are saved asynchronously: the one of
    step 2, written while steps 3 and 4 train, holds step 2's values."""
    config, run = _config(tmp_path, dataset), tmp_path / "run"
    sets = ["parallel.cp=2", "parallel.ep=2", "train.max_steps=4", "train.compile=true", "checkpoint.async_save=true"]
    results = run_distributed(zaya_compiled_on_rank, 2, train_args(config, run, *sets))
    blocks = zaya.get_preset("micro").num_hidden_layers  # write_config's model
    for rank, (code, _, err, compiled) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-6000:]}"
        # per block: 2 norms, attention, 2 residual merges, the router (modules) and the experts' forward
        assert compiled["functions"].count("ParallelExperts.forward") == blocks, compiled
        assert compiled["functions"].count("Module._call_impl") == 6 * blocks, compiled
        # RMSNorm, ResidualScaling, attention in 3 (2 breaks), two routers (the first has no EDA state) and the
        # experts: the blocks share them
        assert 7 <= compiled["graphs"] <= 11, compiled
    assert "mesh dp_replicate 1 x dp_shard 1 x cp 2 (experts over ep 2)" in (run / "train.log").read_text()
    _assert_same_training(run, single, range(1, 3))  # the parameters of step 2's checkpoint
    _assert_same_training(run, single, range(3, 5))


def _train_with_own_config(rank: int, world_size: int, configs: list[str], run: str) -> tuple[int, str, str]:
    return zaya_on_rank(rank, world_size, ["train", configs[rank], "--run-dir", run])


def test_ranks_with_different_settings_stop_before_the_first_step_naming_the_key(dataset, tmp_path):
    configs = [str(write_config(tmp_path / f"rank{r}.toml", dataset, optim={"lr": 0.01 * (r + 1)}))
               for r in range(2)]
    results = run_distributed(_train_with_own_config, 2, configs, str(tmp_path / "run"), timeout=120)
    for code, _, err in results:
        lines = [line for line in err.splitlines() if line.startswith("zaya: error")]
        assert code == 2 and len(lines) == 1, err[-3000:]
        assert "the ranks disagree on config.optim.lr: 0.01 on rank 0, 0.02 on rank 1" in lines[0], lines
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
