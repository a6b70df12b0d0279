"""Models built shard by shard (`zaya.parallel.materialize`): on 2 ranks the shards hold one process's values
exactly, and a rank's peak host memory for the model is about half of one process's."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import zaya
from ranks import run_distributed
from zaya.errors import ZayaError
from zaya.model.transformer import Zaya
from zaya.parallel.config import ParallelConfig, ParallelizeConfig
from zaya.parallel.fsdp import parallelize
from zaya.parallel.launch import Launch
from zaya.parallel.materialize import materialize
from zaya.parallel.mesh import init_parallel


def _peak_bytes(build):
    """What `build()` returns, and how far the process's peak resident memory rose above where it was."""
    status = Path("/proc/self/status")

    def high_water() -> int:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident memory
    before = high_water()
    result = build()
    return result, high_water() - before


def _worker(rank: int, world: int, preset: str) -> dict:
    context = init_parallel(ParallelConfig(), torch.device("cpu"), Launch.from_env(os.environ))
    config = zaya.get_preset(preset)

    def sharded():
        with torch.device("meta"):
            model = Zaya(config)
        return materialize(parallelize(model, context.fsdp_mesh, ParallelizeConfig()), torch.device("cpu"), seed=7)

    def whole():
        torch.manual_seed(7)
        return Zaya(config)

    with torch.device("meta"):  # FSDP2's and DTensor's code loaded and set up before anything is measured
        warm = Zaya(zaya.get_preset("micro"))
    materialize(parallelize(warm, context.fsdp_mesh, ParallelizeConfig()), torch.device("cpu"), seed=7)
    del warm
    reference, whole_peak = _peak_bytes(whole)
    model, sharded_peak = _peak_bytes(sharded)
    expected = reference.state_dict()
    same = [torch.equal(value.full_tensor() if hasattr(value, "full_tensor") else value, expected[name])
            for name, value in model.state_dict().items()]
    context.close()
    return {"same": all(same), "sharded_peak": sharded_peak, "whole_peak": whole_peak,
            "bytes": sum(t.numel() * 4 for t in reference.parameters()),
            "largest": max(t.numel() * 4 for t in reference.parameters())}


@pytest.mark.slow
def test_two_ranks_hold_one_processs_values_in_about_half_its_memory():
    for result in run_distributed(_worker, 2, "small", timeout=240):
        assert result["same"]
        # one process holds the model once (434 MB of fp32); a rank its half and one whole tensor at a time
        # (the largest, 34 MB): 251 MB, 0.58 of it (measured 262-264 MB, 0.60-0.61, once 311 MB in a full suite:
        # the resident size also counts library code first run); a rank that built the whole model would be
        # above 1
        assert result["whole_peak"] >= 0.95 * result["bytes"], result
        assert result["sharded_peak"] <= 1.3 * (result["bytes"] / 2 + result["largest"]), result
        assert result["sharded_peak"] <= 0.8 * result["whole_peak"], result


def test_a_tensor_no_initializer_sets_is_refused(monkeypatch):
    with torch.device("meta"):
        model = Zaya(zaya.get_preset("micro"))
    everything = model.initializers
    forgetful = (item for item in everything() if item[0] is not model.norm.weight)
    monkeypatch.setattr(model, "initializers", lambda: forgetful)
    with pytest.raises(ZayaError, match=r"do not set norm\.weight"):
        materialize(model, torch.device("cpu"), seed=0)
