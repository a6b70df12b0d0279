"""`parallelize`: FSDP2's traffic as counted against its theoretical volume, the units' precisions, the ZeRO-2
mode's one gathering and one reduction per step, and activation checkpointing that changes no number (router
statistics included)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zaya
from ranks import run_distributed
from zaya.model.transformer import RouterStats
from zaya.parallel.config import ParallelConfig, ParallelizeConfig
from zaya.parallel.dtensor import is_dtensor
from zaya.parallel.fsdp import (
    accumulate,
    fsdp_volume,
    parallelize,
    reduce_replicated_gradients,
    refresh,
    release,
    replicated_parameters,
)
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import init_parallel


def _run_config(precision: str = "fp32", checkpointing: str = "none", sharding: str = "full") -> ParallelizeConfig:
    return ParallelizeConfig(activation_checkpointing=checkpointing, bf16=precision == "bf16", sharding=sharding)


def _model(**overrides):
    return zaya.build_model(zaya.get_preset("micro", temp_init=1.0, **overrides), seed=0)


def _volume_worker(rank: int, world: int, replicas: int, precision: str, ep: int) -> dict:
    context = init_parallel(ParallelConfig(dp_replicate=replicas, ep=ep), torch.device("cpu"),
                            Launch.from_env(os.environ))
    model = parallelize(_model(fp32_logits=True), context.fsdp_mesh, _run_config(precision), context.counter,
                        context.experts)
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
    reduce_replicated_gradients(model, context.fsdp_mesh, context.counter)
    sent = context.counter.take()
    theory = fsdp_volume(_model(fp32_logits=True), world // replicas, replicas, precision, ep=ep)
    routers = replicated_parameters(model)
    assert routers and not any(is_dtensor(p) for p in routers)  # whole on every rank, in no unit
    router_grads = torch.cat([p.grad.reshape(-1) for p in routers])
    return {"sent": sent, "theory": theory, "dtypes": {k: str(v) for k, v in seen.items()},
            "router_elements": sum(p.numel() for p in routers), "router_grads": router_grads}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "replicas", "precision", "ep"),
                         [(2, 1, "fp32", 1), (2, 1, "bf16", 2), (4, 2, "fp32", 2)],
                         ids=["fsdp-fp32", "fsdp-bf16-ep2", "hsdp-fp32-ep2"])
def test_fsdp_traffic_matches_its_theoretical_volume(world, replicas, precision, ep):
    """With expert parallelism (ep 2) each block's experts are a unit of 1/ep of the experts, over the ranks
    holding them (one here, or one per replica under HSDP): they are not gathered, and the tokens travel."""
    results = run_distributed(_volume_worker, world, replicas, precision, ep, timeout=240)
    for result in results:
        assert (result["sent"].get("experts", 0) > 0) == (ep > 1)
        fsdp = sum(v for k, v in result["sent"].items() if k.startswith("fsdp_"))
        # measured from the collectives themselves; above the theory only by the padding of uneven shards
        assert 1.0 <= fsdp / result["theory"] <= 1.1, result
        assert ("fsdp_all_reduce" in result["sent"]) == (replicas > 1)
        low = "torch.bfloat16" if precision == "bf16" else "torch.float32"
        # the router keeps fp32 parameters under bf16 mixed precision, the rest of a block does not
        assert result["dtypes"] == {"router": "torch.float32", "attention": low}
        # the routers' gradients: one fp32 all-reduce over every rank, after which every rank has the same
        assert result["sent"]["replicated"] == 2 * result["router_elements"] * 4 * (world - 1) // world
        torch.testing.assert_close(result["router_grads"], results[0]["router_grads"], rtol=0, atol=0)


def _accumulation_worker(rank: int, world: int) -> dict:
    """Two steps of 8 sequences per rank (a plain SGD update, then an evaluation's forward) in each mode and
    number of micro-batches: the bytes sent in each step (ZeRO-1's gathering after the update included), the
    losses, the gradients."""
    context = init_parallel(ParallelConfig(), torch.device("cpu"), Launch.from_env(os.environ))
    batches = [torch.randint(0, 512, (8, 17), generator=torch.Generator().manual_seed(10 * step + rank))
               for step in range(2)]
    results = {}
    for sharding, micro_batches in (("full", 4), ("zero2", 1), ("zero2", 2), ("zero2", 4), ("zero1", 4)):
        model = parallelize(_model(), context.fsdp_mesh, _run_config(sharding=sharding), context.counter)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        sent, losses = [], []
        for batch in batches:
            context.counter.take()
            total = 0.0
            for index, micro in enumerate(batch.chunk(micro_batches)):
                accumulate(model, sharding, last=index == micro_batches - 1)
                loss = model.loss(micro[:, :-1], micro[:, 1:])
                (loss * micro.shape[0] / batch.shape[0]).backward()
                total += loss.item() * micro.shape[0] / batch.shape[0]
            reduce_replicated_gradients(model, context.fsdp_mesh, context.counter)
            losses.append(total)
            grads = [p.grad.full_tensor() if is_dtensor(p.grad) else p.grad.clone()
                     for group in optimizer.param_groups for p in group["params"]]
            optimizer.step()
            refresh(model, sharding)
            sent.append(sum(v for k, v in context.counter.take().items() if k.startswith("fsdp_") or k == "replicated"))
            optimizer.zero_grad()
            with torch.no_grad():  # the new weights gathered and kept, then freed: the next step gathers again
                model.loss(batch[:2, :-1], batch[:2, 1:])
            release(model, sharding)
        routers = sum(p.numel() for p in replicated_parameters(model))
        theory = fsdp_volume(_model(), world, 1, "fp32", micro_batches, sharding=sharding) + \
            2 * routers * 4 * (world - 1) / world
        results[sharding, micro_batches] = {"sent": sent, "theory": theory, "losses": losses, "grads": grads}
    return results


@pytest.mark.slow
def test_zero2_and_zero1_gather_and_reduce_once_per_step_and_train_as_full_sharding():
    for result in run_distributed(_accumulation_worker, 2, timeout=240):
        full = result["full", 4]
        for micro_batches in (1, 2, 4):
            zero2 = result["zero2", micro_batches]
            for sent in zero2["sent"]:  # the same bytes whatever the micro-batches, as the theory has them
                assert 1.0 <= sent / zero2["theory"] <= 1.1, (micro_batches, sent, zero2["theory"])
                assert sent == pytest.approx(result["zero2", 1]["sent"][0], rel=0.01)
            assert zero2["losses"] == pytest.approx(full["losses"], rel=1e-5)
            for a, b in zip(zero2["grads"], full["grads"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert full["sent"][0] > 3 * result["zero2", 4]["sent"][0]  # full sharding gathers per micro-batch
        # ZeRO-1: the first step gathers twice (the shards it starts from, and the update), then once a step
        zero1 = result["zero1", 4]
        assert zero1["sent"][1] == pytest.approx(zero1["theory"], rel=0.05)
        assert zero1["sent"][1] == pytest.approx(result["zero2", 4]["sent"][1], rel=0.01)
        assert zero1["losses"] == pytest.approx(full["losses"], rel=1e-5)
        for a, b in zip(zero1["grads"], full["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


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
