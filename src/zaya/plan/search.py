"""`zaya plan --search`: every layout of a GPU count (dp_replicate x dp_shard x cp, expert parallelism, sharding
mode, micro-batch, activation checkpointing), planned, the ones that fit ranked by the run's predicted hours, and
each rejected one with its reason; and the smallest GPU count on which the run fits at all.

Context parallelism is searched for the phases that use `[parallel].cp`; a phase with a `cp` of its own keeps
it. Micro-batches are the divisors of a rank's share of the batch, up to 16 sequences. Expert parallelism: 1
and every divisor of the number of experts that divides dp_shard x cp (which is the same in every phase).
"""

from __future__ import annotations

from dataclasses import dataclass

from zaya.config import RunConfig
from zaya.errors import ZayaError
from zaya.parallel.config import SHARDINGS
from zaya.plan.devices import DeviceSpec
from zaya.plan.layout import Layout
from zaya.plan.memory import MODES
from zaya.plan.planner import Plan, plan_run
from zaya.train.run import ResolvedRun

MAX_MICRO_BATCH = 16
MAX_GPUS = 1 << 17


@dataclass
class Candidate:
    layout: Layout
    plan: Plan | None
    reason: str  # empty when it fits

    @property
    def hours(self) -> float:
        return self.plan.hours if self.plan is not None else float("inf")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(run: ResolvedRun, gpus_per_node: int) -> list[Layout]:
    """Every layout of the run's GPUs the search considers (cp inside a node)."""
    result, gpus = [], run.world_size
    batch = run.train.global_batch_size
    for cp in _divisors(gpus):
        if cp > gpus_per_node:
            continue
        for replicate in _divisors(gpus // cp):
            shard = gpus // cp // replicate
            per_rank = batch // (replicate * shard) if batch % (replicate * shard) == 0 else 0
            micro_batches = [m for m in _divisors(per_rank) if m <= MAX_MICRO_BATCH] if per_rank else [1]
            for ep in expert_parallel_sizes(run.model.num_experts, shard * cp):
                compiled = bool(run.train.compile)
                for micro in micro_batches:
                    for mode in MODES:
                        for sharding in SHARDINGS:
                            result.append(Layout(gpus, gpus_per_node, replicate, shard, cp, micro, mode, compiled,
                                                 sharding, ep))
    return result


def expert_parallel_sizes(num_experts: int, shard_ranks: int) -> list[int]:
    """The `parallel.ep` values a mesh allows: whole experts, as many on every rank, in groups of its
    dp_shard x cp ranks."""
    return [ep for ep in _divisors(num_experts) if shard_ranks % ep == 0]


def evaluate(run: ResolvedRun, layout: Layout, device: DeviceSpec, table=None) -> Candidate:
    """Plan `layout` (of the run's GPUs); a layout that cannot run, or does not fit, says why."""
    try:
        plan = plan_run(run, device, table, layout.gpus_per_node, layout)
    except ZayaError as exc:
        return Candidate(layout, None, str(exc).split(": ", 1)[-1])
    if plan.problems:
        return Candidate(layout, plan, "; ".join(plan.problems))
    worst = max(plan.phases, key=lambda phase: phase.memory.total)
    if not worst.fits:
        return Candidate(layout, plan, f"needs {worst.memory.total / 1e9:.1f} GB per {device.unit} in phase "
                                       f"'{worst.name}', the device has {device.memory_bytes / 1e9:.0f} GB")
    return Candidate(layout, plan, "")


def search_layouts(run: ResolvedRun, gpus_per_node: int, device: DeviceSpec, table=None,
                   progress: bool = False) -> list[Candidate]:
    """Every layout of `layouts`, evaluated: the fitting ones first, fastest first, then the rejected
    (`progress`: a bar on stderr)."""
    import sys

    from tqdm import tqdm

    options = layouts(run, gpus_per_node)
    bar = tqdm(options, unit="layout", desc=f"layouts of {run.world_size} GPU(s)", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty(), leave=False)
    candidates = [evaluate(run, layout, device, table) for layout in bar]
    return sorted(candidates, key=lambda c: (bool(c.reason), c.hours))


def leanest(run: ResolvedRun, gpus_per_node: int) -> Layout:
    """The layout of the run's GPUs that needs the least memory: everything sharded, full checkpointing, one
    sequence per micro-batch, the configured cp, the experts over as many ranks as they split over (which
    shrinks their gathered copies and leaves the rest as it is)."""
    gpus, cp = run.world_size, run.parallel.cp
    cp = cp if gpus % cp == 0 else 1
    ep = max(expert_parallel_sizes(run.model.num_experts, gpus))
    return Layout(gpus, gpus_per_node, 1, gpus // cp, cp, 1, "full", bool(run.train.compile), ep=ep)


def smallest_fit(config: RunConfig, precision: str, device: DeviceSpec, gpus_per_node: int,
                 table=None) -> Candidate | None:
    """The fastest layout on the smallest power-of-two GPU count on which `config` (in `precision`) fits (None:
    none does up to `MAX_GPUS`)."""
    gpus = 1
    while gpus <= MAX_GPUS:
        per_node = min(gpus_per_node, gpus)
        run = config.resolve(gpus, precision)
        if not evaluate(run, leanest(run, per_node), device, table).reason:
            best = search_layouts(run, per_node, device, table)
            return best[0] if best and not best[0].reason else None
        gpus *= 2
    return None


def describe(candidate: Candidate) -> str:
    layout = candidate.layout
    return (f"dp_replicate {layout.dp_replicate:>3} x dp_shard {layout.dp_shard:>4} x cp {layout.cp:>2}, "
            f"ep {layout.ep:>2}, {layout.sharding:<5} sharding, micro-batch {layout.micro_batch_size:>2}, "
            f"checkpointing {layout.activation_checkpointing:<4}")
