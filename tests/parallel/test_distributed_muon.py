"""Distributed Muon: on 2 and 3 gloo ranks, and under HSDP on 2 x 2, it equals single-process Muon,
orthogonalises every matrix exactly once in the whole job, and its owner plan balances the Newton-Schulz FLOPs
(over every replica's ranks under HSDP)."""

from __future__ import annotations

import pytest
import torch

from ranks import run_distributed
from zaya.model.presets import get_preset
from zaya.model.transformer import Zaya
from zaya.optim.distributed import MatrixLayout, plan_owners
from zaya.optim.hybrid import split_parameters
from zaya.optim.muon import Muon
from zaya.optim.ns_iteration import newton_schulz_flops
from zaya.parallel.fsdp import shard_dim

# uneven rows, even rows, a wide matrix; stacks that split along E on some world sizes and along their rows
# (or unevenly along E, leaving shards empty) on others
SHAPES = [(5, 12), (24, 16), (12, 40), (3, 8, 12), (1, 4, 4), (4, 6, 8), (6, 9, 6)]
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")


class _Holder(torch.nn.Module):
    def __init__(self, shapes=tuple(SHAPES)) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.matrices = torch.nn.ParameterList(
            torch.nn.Parameter(0.02 * torch.randn(shape, generator=generator)) for shape in shapes
        )


def _grads(steps: int, shapes=tuple(SHAPES)) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


def _muon_shapes(preset: str) -> tuple[tuple[int, ...], ...]:
    with torch.device("meta"):
        model = Zaya(get_preset(preset))
    return tuple(tuple(p.shape) for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params)


def _against_one_process(mesh, shards: int, hyper: dict) -> dict:
    """Three steps of `_Holder`'s matrices sharded over `mesh` (split over its last dimension's `shards` ranks)
    and in one process: what each step orthogonalised here, and whether the results are the same bits."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded, plain = _Holder(), _Holder()
    fully_shard(sharded, mesh=mesh, shard_placement_fn=lambda p: Shard(shard_dim(tuple(p.shape), shards)))
    reference, optimizer = Muon(plain.parameters(), **hyper), Muon(sharded.parameters(), **hyper)
    keys = []
    for step_grads in _grads(3):
        for param, grad in zip(plain.parameters(), step_grads, strict=True):
            param.grad = grad.clone()
        reference.step()
        for param, grad in zip(sharded.parameters(), step_grads, strict=True):
            param.grad = distribute_tensor(grad.clone(), mesh, param.placements)
        optimizer.step()
        keys.append(optimizer.last_report.keys)
    exact = [torch.equal(b.detach().full_tensor(), a.detach())
             for a, b in zip(plain.parameters(), sharded.parameters(), strict=True)]
    errors = [((b.detach().full_tensor() - a.detach()).norm() / a.detach().norm()).item()
              for a, b in zip(plain.parameters(), sharded.parameters(), strict=True)]
    placements = [p.placements[-1].dim for p in sharded.parameters()]
    return {"keys": keys, "exact": exact, "errors": errors, "placements": placements}


def _muon_worker(rank: int, world: int, ns_dtype: str, nesterov: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return _against_one_process(init_device_mesh("cpu", (world,)), world,
                                {**HYPER, "nesterov": nesterov, "ns_dtype": ns_dtype})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("ns_dtype", "nesterov"), [("float32", True), ("bfloat16", False)])
def test_distributed_muon_equals_single_process_muon(world, ns_dtype, nesterov):
    results = run_distributed(_muon_worker, world, ns_dtype, nesterov, timeout=180)
    # both kinds of stack layout occur
    assert {0, 1} <= {dim for r in results for dim in r["placements"]}
    for result in results:
        # the owner normalises the matrix it joined exactly as one process does: the same bits
        assert all(result["exact"]), result["errors"]
    expected = sorted((i, e) for i, shape in enumerate(SHAPES) for e in range(shape[0] if len(shape) == 3 else 1))
    for step in range(3):
        done = [key for result in results for key in result["keys"][step]]
        assert sorted(done) == expected  # every matrix exactly once, on one rank


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owner_plan_balances_the_small_presets_newton_schulz_flops(world):
    with torch.device("meta"):
        model = Zaya(get_preset("small"))
    params = [p for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params]
    layouts = tuple(MatrixLayout(tuple(p.shape), shard_dim(tuple(p.shape), world)) for p in params)
    plan = plan_owners(layouts, world)
    assert plan.imbalance <= 1.15, plan.loads
    owned = sum(1 for layout in layouts if not layout.local_matrices for _ in range(layout.count))
    assert len(plan.owners) == owned > 0


def _hsdp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hyper = {**HYPER, "nesterov": True, "ns_dtype": "float32"}
    # the micro preset's matrices, one step: the Newton-Schulz FLOPs each rank did
    shapes = _muon_shapes("micro")
    model = _Holder(shapes)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(shard_dim(tuple(p.shape), world // 2)))
    optimizer = Muon(model.parameters(), **hyper)
    for param, grad in zip(model.parameters(), _grads(1, shapes)[0], strict=True):
        param.grad = distribute_tensor(grad, mesh, param.placements)
    optimizer.step()
    return {**_against_one_process(mesh, world // 2, hyper), "micro_flops": optimizer.last_report.flops}


@pytest.mark.slow
def test_hsdp_spreads_newton_schulz_over_every_replica_and_equals_one_process():
    results = run_distributed(_hsdp_worker, 4, timeout=180)
    for result in results:
        assert all(result["exact"])  # replicas updated alike, and as one process
    expected = sorted((i, e) for i, shape in enumerate(SHAPES) for e in range(shape[0] if len(shape) == 3 else 1))
    for step in range(3):
        done = [key for result in results for key in result["keys"][step]]
        assert sorted(done) == expected  # every matrix once in the whole job, not once per replica
    total = sum(newton_schulz_flops(*shape[-2:]) * (shape[0] if len(shape) == 3 else 1)
                for shape in _muon_shapes("micro"))
    for result in results:  # each rank about a quarter of the iteration, not a half
        assert result["micro_flops"] == pytest.approx(total / 4, rel=0.15)

@pytest.mark.parametrize(("shards", "replicas"), [(2, 2), (1, 4), (4, 2)])
def test_owners_over_replicas_balance_the_small_presets_newton_schulz_flops(shards, replicas):
    shapes = _muon_shapes("small")
    layouts = tuple(MatrixLayout(shape, shard_dim(shape, shards) if shards > 1 else None) for shape in shapes)
    plan = plan_owners(layouts, shards, replicas)
    total = sum(newton_schulz_flops(*shape[-2:]) * (shape[0] if len(shape) == 3 else 1) for shape in shapes)
    assert sum(plan.loads) == pytest.approx(total)  # each matrix once, on one rank of one replica
    for load in plan.loads:  # each rank about 1 / (replicas x shards) of it
        assert load == pytest.approx(total / (shards * replicas), rel=0.15)
