"""Every attempt of a job on its own store, agreed on by every rank whatever torchrun's per-agent restart counts say
(zaya.parallel.launch)."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
from tests.ranks import run_distributed

from zaya.errors import StartupFailed
from zaya.parallel.launch import Launch


def _attempt(rank: int, restart: int, delay_s: float) -> dict:
    """One attempt of the job: start-up check, a process group on the attempt's store, one all-reduce."""
    launch = dataclasses.replace(Launch.from_env(os.environ), restart=restart, init_timeout_s=30.0)
    if rank == 0:
        time.sleep(delay_s)  # the other ranks read the earlier attempt's address first
    with launch.startup():
        pass
    dist.init_process_group("gloo", store=launch.store(), rank=launch.rank, world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=30))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen = launch.gather("attempt", str(launch.attempt))
    dist.destroy_process_group()
    return {"attempt": launch.attempt, "seen": seen, "sum": total.item(), "launch": launch}


def _two_attempts(rank: int, world: int) -> dict:
    """The first attempt ends (its processes and rank 0's store gone); the second starts with restart counts that
    differ between ranks, as when torchrun restarts one agent's healthy workers without counting."""
    first = _attempt(rank, 0, 0.0)
    agents = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=30))
    agents.add("test/ended", 1)
    launch = first.pop("launch")
    if rank == 0:  # every rank is done with the first attempt's store before rank 0's goes
        while int(agents.add("test/ended", 0)) < world:
            time.sleep(0.05)
        launch._store = None  # what the end of rank 0's process does to its server
        gc.collect()
        agents.set("test/first-ended", "yes")
    else:
        agents.wait(["test/first-ended"])
    del launch
    second = _attempt(rank, rank % 2, 1.0)
    second.pop("launch")
    return {"first": first, "second": second}


@pytest.mark.slow
def test_ranks_agree_on_the_attempt_when_torchruns_restart_counts_differ():
    results = run_distributed(_two_attempts, 3, timeout=120)
    for result in results:
        assert result["first"]["attempt"] == 0 and result["first"]["seen"] == ["0"] * 3
        assert result["second"]["attempt"] == 1 and result["second"]["seen"] == ["1"] * 3
        assert result["first"]["sum"] == result["second"]["sum"] == 6.0


def _without_rank_0(rank: int, world: int) -> str:
    launch = dataclasses.replace(Launch.from_env(os.environ), init_timeout_s=3.0)
    if rank == 0:
        return "absent"
    try:
        launch.store()
    except StartupFailed as exc:
        return str(exc)
    return "joined"


def test_a_rank_waits_for_rank_0s_store_only_until_its_timeout():
    _, message = run_distributed(_without_rank_0, 2, timeout=60)
    assert message == "rank 0 did not open the job's store within 3 s (see its log)"
