"""`parallelize(model, mesh, config)`: activation checkpointing, compilation and FSDP2 / HSDP, applied from
outside to a plain `Zaya` (the model files know nothing of ranks). Context parallelism needs nothing here:
FSDP2 shards over dp_shard x cp together (`ParallelContext.fsdp_mesh`), and the trainer hands each forward
its `zaya.parallel.context.ContextParallel`.

Order (torchtitan's): checkpointing, then compilation, then sharding, so that FSDP's hooks wrap each block's
checkpointed, compiled forward. The same code runs on one rank (a one-rank mesh: nothing is split, nothing
is sent) and on many.

Units, each one all-gather in forward (and again in backward) and one reduce-scatter of its gradients:
every block, and the root (embedding, final norm). The root's forward method is `Zaya.loss` as well as
`Zaya.forward`.

The routers are no part of any unit: they stay whole and fp32 on every rank (`replicated_parameters`:
routing decisions are discrete, and bf16 rounding of the router's weights flips them; ZAYA1-base's 40 routers
hold 0.3% of its parameters). No router is gathered, and their gradients are averaged over the data-parallel
ranks in one all-reduce per step (`reduce_replicated_gradients`, after the last micro-batch) instead of a
gathering and a reduction of 40 small units per micro-batch. A compiled block (`train.compile`: one graph,
and FSDP's hooks are never traced, so no unit may nest in it) is then one bf16 unit like an eager one; with
expert parallelism, whose experts are a unit inside the block, the block compiles around them
(`compile_around_experts`).

Mixed precision (`train.precision = "bf16"`): the blocks' parameters are all-gathered and used in bf16, the
root's too unless `fp32_logits` (so that the tied LM head runs in fp32 as in one process) keeps it fp32;
gradients are reduced in fp32 into the fp32 shards the optimizer updates. Forward inputs are not cast: the
residual stream stays fp32, and autocast still covers the activations.

Sharding modes (`parallel.sharding`). "full" (ZeRO-3): every micro-batch gathers each block for its forward and
again for its backward, and reduce-scatters its gradients (with HSDP, all-reduces them over the replicas).
"zero2": a step gathers each unit once, in its first micro-batch's forward, and keeps it to the end of the
step; gradients accumulate unsharded (in fp32, FSDP2's accumulator for a lower parameter dtype) and are
reduced once, in the last micro-batch's backward (`accumulate`). The bytes sent per step no longer grow with
the micro-batches; the memory for whole parameters and, with more than one micro-batch, whole fp32
gradients does. "zero1", ZAYA1's layout: the whole parameters are kept across steps, every rank holding the
model as in plain data parallelism, with the optimizer state and Newton-Schulz sharded; once per step the
gradients are reduced (a reduce-scatter: each rank's optimizer needs only the sum of its shard) and, after
the update, the parameters gathered again (`refresh`). The same bytes as ZeRO-2, but the gathering waits for
the update where ZeRO-2's overlaps the next forward. All modes keep the same fp32 shards, optimizer state and
checkpoints, so a run moves between them on resume.

Placement: every parameter is split along its first dimension (`torch.chunk`'s rows), except a stack of
experts [E, m, n] whose E does not divide evenly over the ranks while its rows m do: it is split along m, so
that memory stays balanced (E = 16 on 32 ranks would leave half of them empty), and Muon then gives each of
its matrices an owner (`zaya.optim.distributed`). Split along E, every shard holds whole experts and Muon needs
no communication for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from zaya.errors import ZayaError
from zaya.model.transformer import Zaya
from zaya.parallel.comm import CommCounter, all_reduce, count_fsdp
from zaya.parallel.config import ACTIVATION_CHECKPOINTING, SHARDINGS, ParallelizeConfig
from zaya.parallel.dtensor import clip_grad_norm_, slots_group
from zaya.parallel.experts import ParallelExperts, expert_span, finish_gradients, shard_experts
from zaya.parallel.mesh import ExpertMesh, ParallelContext


def shard_dim(shape: tuple[int, ...], ranks: int) -> int:
    """The dimension FSDP2 splits a parameter of `shape` along over `ranks` ranks (see the module docstring)."""
    if len(shape) == 3 and shape[0] % ranks and shape[1] % ranks == 0:
        return 1
    return 0


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` call: the module, whether its parameters stay fp32 under bf16 mixed precision, and
    whether FSDP frees them after forward (and all-gathers them again in backward)."""

    module: nn.Module
    keep_fp32: bool
    reshard_after_forward: bool
    experts: bool = False  # a block's `ParallelExperts`: sharded over the ranks holding the same experts


def fsdp_units(model: Zaya) -> Iterator[Unit]:
    """The units of the module docstring, innermost first (the order `fully_shard` must see them in)."""
    for block in model.blocks:
        if isinstance(block.moe.experts, ParallelExperts):
            yield Unit(block.moe.experts, keep_fp32=False, reshard_after_forward=True, experts=True)
        yield Unit(block, keep_fp32=False, reshard_after_forward=True)
    # FSDP2 keeps the root's parameters gathered from forward to backward: they are needed first in backward
    yield Unit(model, keep_fp32=model.config.fp32_logits, reshard_after_forward=False)


def replicated_parameters(model: Zaya) -> list[nn.Parameter]:
    """The parameters no unit takes: every router's, whole and fp32 on every rank."""
    return [p for block in model.blocks for p in block.moe.router.parameters()]


def unit_parameters(model: Zaya) -> list[tuple[Unit, list[nn.Parameter]]]:
    """Each unit with the parameters `fully_shard` gives it: its own, less those of the units before it and
    the replicated ones."""
    taken: set[int] = {id(p) for p in replicated_parameters(model)}
    result = []
    for unit in fsdp_units(model):
        params = [p for p in unit.module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        result.append((unit, params))
    return result


def parallelize(model: Zaya, mesh: DeviceMesh, config: ParallelizeConfig, counter: CommCounter | None = None,
                experts: ExpertMesh | None = None, *, context_parallel: bool = False) -> Zaya:
    """Apply `config`'s activation checkpointing, compilation and mixed precision and FSDP2 to `model`, in place;
    returns it. `mesh` is `ParallelContext.fsdp_mesh`: one dimension (the shards), or two (replicas, shards:
    HSDP). `counter` counts the bytes FSDP sends. With `experts` (expert parallelism) the blocks' experts are
    split over its groups first (`zaya.parallel.experts.shard_experts`) and each is a unit of its own, sharded
    over `experts.fsdp_mesh`. `context_parallel`: the blocks will see sequences split over ranks, whose
    exchanges (the convolutions' halo, attention over the whole sequence) run eagerly between the graphs of a
    compiled attention (`CONTEXT_PARALLEL_BREAKS`)."""
    if experts is not None:
        shard_experts(model, experts, counter)
        if config.compile:
            # the token exchange's split sizes, read on the host, enter the block's graph as sizes it cannot know
            # (bounded by `torch._check`) instead of breaking it
            torch._dynamo.config.capture_scalar_outputs = True
    if config.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ZayaError(f"activation checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, got "
                        f"{config.activation_checkpointing!r}")
    if config.sharding not in SHARDINGS:
        raise ZayaError(f"sharding must be one of {', '.join(SHARDINGS)}, got {config.sharding!r}")
    for block in model.blocks:
        if config.activation_checkpointing == "full":
            recompute_in_backward(block)
        elif config.activation_checkpointing == "moe":
            recompute_in_backward(block.moe)
        if config.compile and experts is None:
            # one graph per block, and the same code for every block past the first (its router has no EDA
            # state): the block's parameters are graph inputs, and nothing in it reads its index
            block.compile(fullgraph=not context_parallel)
        elif config.compile:
            compile_around_experts(block, context_parallel)
    bf16 = config.bf16
    replicated = set(replicated_parameters(model))
    for unit in fsdp_units(model):
        unit_mesh = experts.fsdp_mesh if unit.experts else mesh
        replicas = unit_mesh.size(0) if unit_mesh.ndim == 2 else 1
        ranks = unit_mesh.size(unit_mesh.ndim - 1)
        low = torch.bfloat16 if bf16 and not unit.keep_fp32 else None
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if bf16 else None,
                                      cast_forward_inputs=False)
        # on one rank a shard is the whole tensor: freeing the gathered copy after forward saves nothing and
        # costs a second gathering copy in backward
        reshard = gathers_per_micro_batch(unit, config.sharding, ranks) == 2
        fully_shard(unit.module, mesh=unit_mesh, reshard_after_forward=reshard,
                    shard_placement_fn=functools.partial(_placement, ranks=ranks), mp_policy=policy,
                    ignored_params=replicated)
        if counter is not None:
            count_fsdp(unit.module, counter, replicas)
    register_fsdp_forward_method(model, "loss")
    return model


SUBLAYERS_AROUND_EXPERTS = ("attn_norm", "attn", "attn_residual", "moe_norm", "moe.router", "moe_residual")
# the calls a compiled attention makes eagerly under context parallelism (`torch.compiler.disable`: collectives
# inside), each a break between two of its graphs: the convolutions' halo and the attention over the sequence
CONTEXT_PARALLEL_BREAKS = 2


def compile_around_experts(block: nn.Module, context_parallel: bool = False) -> None:
    """`train.compile` for a block whose experts are an FSDP unit of their own (expert parallelism): FSDP2 keeps
    its hooks out of any graph, so no graph may hold the experts' call. Each sublayer around them is a graph of
    its own (attention, under context parallelism, several: `CONTEXT_PARALLEL_BREAKS`), and the experts'
    forward (the token exchange and the grouped matmuls, between the hooks) is one more; what joins them (the
    routes' weights, the skip route) runs eagerly."""
    for name in SUBLAYERS_AROUND_EXPERTS:
        block.get_submodule(name).compile(fullgraph=not (context_parallel and name == "attn"))
    experts = block.moe.experts
    experts.forward = torch.compile(experts.forward, fullgraph=True)


def reduce_and_clip(model: Zaya, params: list[nn.Parameter], context: ParallelContext, max_norm: float,
                    all_reduce: Callable[[torch.Tensor, object], None] | None = None) -> torch.Tensor:
    """After the step's last backward: the replicated parameters' gradients averaged, the experts' made averages
    over every data-parallel rank (expert parallelism), and `params` (the optimizer's: the shards) clipped to
    a global norm of `max_norm` (0: measured only); returns the norm before clipping."""
    reduce_replicated_gradients(model, context.fsdp_mesh, context.counter)
    experts = context.experts
    if experts is not None:
        finish_gradients(params, experts)
    spans = None if experts is None else functools.partial(expert_span, experts=experts)
    return clip_grad_norm_(params, max_norm, all_reduce, spans)


def _placement(param: nn.Parameter, ranks: int) -> Shard:
    return Shard(shard_dim(tuple(param.shape), ranks))


def reduce_replicated_gradients(model: Zaya, mesh: DeviceMesh, counter: CommCounter | None = None) -> None:
    """Average the replicated parameters' gradients over every rank of `mesh` (the FSDP mesh), as FSDP2 averages
    its units' gradients: one all-reduce, once per step, after the last micro-batch's backward."""
    if mesh.size() == 1:
        return
    grads = [p.grad for p in replicated_parameters(model) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, slots_group(tuple(int(r) for r in mesh.mesh.flatten().tolist())), counter, "replicated")
    flat /= mesh.size()
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]),
                                                                     grads, strict=True)])


def gathers_per_micro_batch(unit: Unit, sharding: str, ranks: int) -> int:
    """All-gathers of `unit` in a micro-batch that gathers it: 2 where it is freed after forward (a block under
    full sharding on more than one rank), else 1."""
    return 2 if unit.reshard_after_forward and sharding == "full" and ranks > 1 else 1


def collectives_per_step(sharding: str, micro_batches: int) -> int:
    """How many of its micro-batches gather each unit and reduce its gradients: every one under full
    sharding, one (or one gathering after the update) under ZeRO-2 and ZeRO-1."""
    return micro_batches if sharding == "full" else 1


def accumulate(model: nn.Module, sharding: str, last: bool) -> None:
    """Before each micro-batch of a step: under ZeRO-2 and ZeRO-1 only the `last` reduces the gradients
    (FSDP2's `set_requires_gradient_sync`; with HSDP the replicas' all-reduce goes with the reduction), and
    under ZeRO-2 only the last frees the gathered parameters (`set_reshard_after_backward`), which ZeRO-1 keeps.
    Nothing under full sharding."""
    if sharding == "full":
        return
    model.set_requires_gradient_sync(last, recurse=True)
    model.set_reshard_after_backward(last and sharding == "zero2", recurse=True)


def refresh(model: nn.Module, sharding: str) -> None:
    """After the optimizer updated the shards: under ZeRO-1, gather the whole parameters again (one all-gather
    per unit and step)."""
    if sharding != "zero1":
        return
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.reshard()
    for unit in units:
        unit.unshard()


def release(model: nn.Module, sharding: str | None = None) -> None:
    """Free the gathered whole parameters: after an evaluation's forward under ZeRO-2 (it would keep them to
    the next backward), and under any mode (`sharding` None) after a checkpoint is loaded into the shards,
    which leaves gathered copies stale."""
    if sharding not in (None, "zero2"):
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def recompute_in_backward(module: nn.Module) -> None:
    """Activation checkpointing of `module`: its forward runs again in backward instead of keeping what it
    saves (`torch.utils.checkpoint`, non-reentrant), with its parameter names unchanged. The composable
    `checkpoint` would do the same through hooks the compiler cannot trace; this compiles into the block's
    graph."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    module.recomputed_in_backward = True


def is_recomputed(module: nn.Module) -> bool:
    """Whether `recompute_in_backward` was applied to `module`."""
    return getattr(module, "recomputed_in_backward", False)


def fsdp_volume(model: Zaya, shard_ranks: int, replicas: int, precision: str, micro_batches: int = 1,
                sharding: str = "full", ep: int = 1) -> float:
    """FSDP2's theoretical bytes sent per rank in one optimizer step of `micro_batches` micro-batches, by the
    formulas of `zaya.parallel.comm` and without the padding of uneven shards: per unit and micro-batch that
    gathers it (`collectives_per_step`) one all-gather of its parameters in forward, one more in backward if
    it is freed after forward, one reduce-scatter of its gradients (fp32), and with HSDP one all-reduce of the
    reduced shards. `model` is a plain `Zaya`; with `ep` > 1 each block's experts are a unit of their own,
    1/ep of them over shard_ranks / ep ranks (`zaya.parallel.experts`)."""
    total = 0.0
    for unit, params in unit_parameters(model):
        moe = getattr(unit.module, "moe", None)
        split = {id(p) for p in moe.experts.parameters()} if moe is not None and ep > 1 else set()
        total += _unit_volume(unit, sum(p.numel() for p in params if id(p) not in split), shard_ranks, replicas,
                              precision, sharding)
        if split:
            total += _unit_volume(unit, sum(p.numel() for p in params if id(p) in split) / ep, shard_ranks // ep,
                                  replicas, precision, sharding)
    return total * collectives_per_step(sharding, micro_batches)


def _unit_volume(unit: Unit, numel: float, n: int, replicas: int, precision: str, sharding: str) -> float:
    param_bytes = 2 if precision == "bf16" and not unit.keep_fp32 else 4
    return (gathers_per_micro_batch(unit, sharding, n) * numel * param_bytes * (n - 1) / n
            + numel * 4 * (n - 1) / n + 2 * (numel / n) * 4 * (replicas - 1) / replicas)
