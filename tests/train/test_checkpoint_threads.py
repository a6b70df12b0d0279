"""A checkpoint leaves no thread behind: after a save (synchronous or async) or a load on one rank, the process runs
the threads it ran before.

A thread that stays costs every later step, even asleep: one that once ran a parallel region keeps an OpenMP team,
and libgomp, managing more threads than there are cores, stops spin-waiting at the barriers of the training
thread's own parallel regions (steps a quarter slower on a 2-core CPU). DCP's collectives made such teams in gloo's
threads, which live as long as their group, though one rank has nothing to coordinate.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from ranks import run_distributed
from zaya import checkpoint as ckpt


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _settled(before: set[int], seconds: float = 5.0) -> set[int]:
    """The threads beyond `before` that are still there after `seconds` (DCP's executor of an async save ends on its
    own, just after the save's future is done)."""
    deadline = time.monotonic() + seconds
    while (extra := _threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def _save_and_load(rank: int, world_size: int, root: str, async_save: bool) -> dict:
    torch.set_num_threads(2)  # a team of two in any thread that copies enough, whatever the machine's cores
    dist.init_process_group("gloo")
    control = dist.new_group(backend="gloo")  # as the trainer's control group: gloo threads of its own
    # a training state's many tensors: DCP's save and load plans, pickled, are tens of KB
    state = {"model": {f"layer{i}.weight": torch.randn(8, 8) for i in range(400)}}
    torch.randn(1 << 17).add_(1)  # the training thread's own team is up before the count
    manager = ckpt.CheckpointManager(root, keep=2, control_group=control)
    info = {"format": ckpt.FORMAT, "version": ckpt.VERSION}
    left = {}
    for step in (1, 2):  # the second save refills async_save's host copies
        before = _threads()
        manager.save(step, state, {}, info, async_save=async_save)
        manager.wait()
        left[f"save {step}"] = len(_settled(before))
    resumed = dist.new_group(backend="gloo")  # a resume's group: gloo threads that ran nothing yet
    before = _threads()
    loaded = {"model": {key: torch.zeros_like(value) for key, value in state["model"].items()}}
    ckpt.load_tensors(manager.newest_valid(), loaded, process_group=resumed)
    left["load"] = len(_settled(before))
    assert all(torch.equal(loaded["model"][key], value) for key, value in state["model"].items())
    return left


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_leaves_no_thread_behind(tmp_path, async_save):
    (left,) = run_distributed(_save_and_load, 1, str(tmp_path / "checkpoints"), async_save, timeout=60)
    assert left == {"save 1": 0, "save 2": 0, "load": 0}, f"threads left behind: {left}"
