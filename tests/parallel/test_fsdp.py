"""`parallelize`: FSDP2's traffic as counted against its theoretical volume, the units' precisions, and
activation checkpointing that changes no number (router statistics included)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zaya
from ranks import run_distributed
from zaya.model.transformer import RouterStats
from zaya.parallel.config import ParallelConfig, ParallelizeConfig
from zaya.parallel.fsdp import fsdp_volume, parallelize
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import init_parallel


def _run_config(precision: str = "fp32", checkpointing: str = "none") -> ParallelizeConfig:
    return ParallelizeConfig(activation_checkpointing=checkpointing, bf16=precision == "bf16")


def _model(**overrides):
    return zaya.build_model(zaya.get_preset("micro", temp_init=1.0, **overrides), seed=0)


def _volume_worker(rank: int, world: int, replicas: int, precision: str) -> dict:
    context = init_parallel(ParallelConfig(dp_replicate=replicas), torch.device("cpu"), Launch.from_env(os.environ))
    model = parallelize(_model(fp32_logits=True), context.fsdp_mesh, _run_config(precision), context.counter)
    seen = {}

    def note(name: str, weight: str):
        def hook(module, args) -> None:  # the dtype its forward sees, once FSDP has gathered the parameters
            seen.setdefault(name, getattr(module, weight).weight.dtype)
        return hook

    model.blocks[0].moe.router.register_forward_pre_hook(note("router", "fc1"))
    model.blocks[0].attn.register_forward_pre_hook(note("attention", "q_proj"))
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    sent = context.counter.take()
    theory = fsdp_volume(_model(fp32_logits=True), world // replicas, replicas, precision)
    return {"sent": sent, "theory": theory, "dtypes": {k: str(v) for k, v in seen.items()}}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "replicas", "precision"), [(2, 1, "fp32"), (2, 1, "bf16"), (4, 2, "fp32")],
                         ids=["fsdp-fp32", "fsdp-bf16", "hsdp-fp32"])
def test_fsdp_traffic_matches_its_theoretical_volume(world, replicas, precision):
    for result in run_distributed(_volume_worker, world, replicas, precision, timeout=240):
        fsdp = sum(v for k, v in result["sent"].items() if k.startswith("fsdp_"))
        # measured from the collectives themselves; above the theory only by the padding of uneven shards
        assert 1.0 <= fsdp / result["theory"] <= 1.1, result
        assert ("fsdp_all_reduce" in result["sent"]) == (replicas > 1)
        low = "torch.bfloat16" if precision == "bf16" else "torch.float32"
        # the router keeps fp32 parameters under bf16 mixed precision, the rest of a block does not
        assert result["dtypes"] == {"router": "torch.float32", "attention": low}


@pytest.fixture
def one_rank():
    context = init_parallel(ParallelConfig(), torch.device("cpu"), Launch())
    yield context
    context.close()


@pytest.mark.parametrize("checkpointing", ["full", "moe"])
def test_activation_checkpointing_changes_no_number(one_rank, checkpointing):
    plain = _model()
    sharded = parallelize(copy.deepcopy(plain), one_rank.fsdp_mesh, _run_config(checkpointing=checkpointing))
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (plain, sharded):
        stats = RouterStats(len(model.blocks), model.config.num_experts + 1)
        loss = model.loss(ids[:, :-1], ids[:, 1:], router_stats=stats)
        loss.backward()  # the recomputed forward routes again, and records nothing: the model's loop records
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        results.append((loss.detach(), stats.counts.clone(), grads))
    (loss_a, counts_a, grads_a), (loss_b, counts_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(counts_a, counts_b)
    assert counts_a.sum() == 4 * 32 * len(plain.blocks)  # every token counted once per layer
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)
