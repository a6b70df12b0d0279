"""`zaya plan --search` and `parallel.layout = "auto"`: every layout of a GPU count (dp_replicate x dp_shard x cp,
expert parallelism, sharding mode, micro-batch, activation checkpointing), planned, the ones that fit ranked by
the run's predicted hours, and each rejected one with its reason; and the smallest GPU count on which the run
fits at all.

Context parallelism is chosen phase by phase: a phase whose cp is fixed (`Constraints`) keeps it, and each of
the others takes the cp that makes it fastest among those that fit, so a long-context phase may split its
sequences where the short ones do not. Micro-batches are the divisors of a rank's share of the batch, up to 16
sequences. Expert parallelism: 1 and every divisor of the number of experts that divides dp_shard x cp (which
is the same in every phase). The settings a config gives are kept (`Constraints.of_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zaya.config import RunConfig
from zaya.errors import ZayaError
from zaya.parallel.config import SHARDINGS
from zaya.plan.devices import DeviceSpec
from zaya.plan.layout import Layout
from zaya.plan.memory import MODES
from zaya.plan.planner import Plan, Planner, plan_run
from zaya.train.run import ResolvedRun

MAX_MICRO_BATCH = 16
MAX_GPUS = 1 << 17
GB = 1e9
# layouts predicted within this fraction of the fastest's hours are a tie the cost model cannot break (its
# errors are larger: docs/planning.md); of those the one that needs the least memory is ranked first, the
# headroom kept against a prediction that is low
NEAR = 0.01


@dataclass(frozen=True)
class Constraints:
    """What a search keeps: the layout settings given ({"parallel.ep": 8, ...}, keys of
    `zaya.config.LAYOUT_KEYS`), and each phase's cp where it is fixed (None: searched)."""

    settings: dict = field(default_factory=dict)
    phase_cp: tuple[int | None, ...] = ()

    @classmethod
    def of_run(cls, run: ResolvedRun) -> Constraints:
        """A resolved run's: the phases with a cp of their own keep it; nothing else is kept."""
        return cls({}, tuple(p.cp if p.cp != run.parallel.cp else None for p in run.phases))

    @classmethod
    def of_config(cls, config: RunConfig, run: ResolvedRun) -> Constraints:
        """What a config keeps (`RunConfig.given`): under `parallel.layout = "auto"` every layout key it gives,
        and `parallel.cp` for the phases without their own; otherwise only the phases' own cps."""
        given = config.given
        auto = config.parallel.layout == "auto"
        settings = {key: _value(config, key) for key in given if auto and not key.startswith("phases.")}
        fixed = [index for index in range(len(run.phases))
                 if f"phases.{index}.cp" in given or (auto and "parallel.cp" in given)]
        return cls(settings, tuple(run.phases[i].cp if i in fixed else None for i in range(len(run.phases))))

    def fixed(self, index: int) -> int | None:
        return self.phase_cp[index] if index < len(self.phase_cp) else None

    def allows(self, key: str, value) -> bool:
        return key not in self.settings or self.settings[key] == value


def _value(config: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


@dataclass
class Candidate:
    """One layout weighed: its plan, and why it cannot be used (empty when it fits). `layout` is the first
    phase's mesh; `phase_cp` every phase's cp, `searched` which of them the search chose."""

    layout: Layout
    plan: Plan | None
    reason: str  # empty when it fits
    phase_cp: tuple[int, ...] = ()
    searched: tuple[bool, ...] = ()
    shortfall: float = 0.0  # bytes per GPU beyond the device's memory, where memory is all that keeps it out

    @property
    def hours(self) -> float:
        return self.plan.hours if self.plan is not None and not self.reason else float("inf")

    @property
    def peak_memory(self) -> float:
        """Bytes per GPU of its most demanding phase (inf where it has no plan)."""
        return max(phase.memory.total for phase in self.plan.phases) if self.plan is not None else float("inf")

    def settings(self) -> list[str]:
        """The `--set` overrides that give a run this layout: `Layout.settings`, with `parallel.cp` the cp of the
        phases the search chose for, and `phases.N.cp` for each of those whose cp differs from it."""
        settings = self.layout.settings()
        chosen = [cp for cp, searched in zip(self.phase_cp, self.searched, strict=True) if searched]
        if not chosen:
            return [s for s in settings if not s.startswith("parallel.cp=")]
        first = chosen[0]
        settings = [f"parallel.cp={first}" if s.startswith("parallel.cp=") else s for s in settings]
        if len(self.phase_cp) > 1:
            settings += [f"phases.{index}.cp={cp}" for index, (cp, searched)
                         in enumerate(zip(self.phase_cp, self.searched, strict=True)) if searched and cp != first]
        return settings


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(run: ResolvedRun, gpus_per_node: int, constraints: Constraints | None = None) -> list[Layout]:
    """Every layout of the run's GPUs the search considers (cp inside a node), within `constraints`."""
    constraints = constraints or Constraints.of_run(run)
    result, gpus = [], run.world_size
    batch = run.train.global_batch_size
    fixed = {constraints.fixed(i) for i in range(len(run.phases))}
    searching = None in fixed or not run.phases
    allow = constraints.allows
    for cp in _divisors(gpus):
        if (cp > gpus_per_node and cp not in fixed) or not (searching or cp in fixed) or not allow("parallel.cp", cp):
            continue
        for replicate in _divisors(gpus // cp):
            shard = gpus // cp // replicate
            if not allow("parallel.dp_replicate", replicate) or not allow("parallel.dp_shard", shard):
                continue
            per_rank = batch // (replicate * shard) if batch % (replicate * shard) == 0 else 0
            micro_batches = [m for m in _divisors(per_rank) if m <= MAX_MICRO_BATCH] if per_rank else [1]
            for ep in expert_parallel_sizes(run.model.num_experts, shard * cp):
                compiled = bool(run.train.compile)
                for micro in micro_batches:
                    for mode in MODES:
                        for sharding in SHARDINGS:
                            if all((allow("parallel.ep", ep), allow("train.micro_batch_size", micro),
                                    allow("train.activation_checkpointing", mode),
                                    allow("parallel.sharding", sharding))):
                                result.append(Layout(gpus, gpus_per_node, replicate, shard, cp, micro, mode,
                                                     compiled, sharding, ep))
    return result


def expert_parallel_sizes(num_experts: int, shard_ranks: int) -> list[int]:
    """The `parallel.ep` values a mesh allows: whole experts, as many on every rank, in groups of its
    dp_shard x cp ranks."""
    return [ep for ep in _divisors(num_experts) if shard_ranks % ep == 0]


def evaluate(run: ResolvedRun, layout: Layout, device: DeviceSpec, table=None) -> Candidate:
    """Plan `layout` (of the run's GPUs; phases with a cp of their own keep it); a layout that cannot run, or
    does not fit, says why."""
    try:
        plan = plan_run(run, device, table, layout.gpus_per_node, layout)
    except ZayaError as exc:
        return Candidate(layout, None, str(exc).split(": ", 1)[-1])
    if plan.problems:
        return Candidate(layout, plan, "; ".join(plan.problems))
    worst = max(plan.phases, key=lambda phase: phase.memory.total)
    if not worst.fits:
        return Candidate(layout, plan, _too_big(worst.name, worst.memory.total, device),
                         shortfall=worst.memory.total - device.memory_bytes)
    return Candidate(layout, plan, "")


def _too_big(phase: str, memory: float, device: DeviceSpec) -> str:
    return (f"needs {memory / GB:.1f} GB per {device.unit} in phase '{phase}', the device has "
            f"{device.memory_bytes / GB:.0f} GB")


def search_layouts(run: ResolvedRun, gpus_per_node: int, device: DeviceSpec, table=None, progress: bool = False,
                   constraints: Constraints | None = None) -> list[Candidate]:
    """One candidate per layout of `layouts` but cp, each phase at its fastest cp that fits, ranked (`rank`: the
    fitting ones first, fastest first, the leanest of the near-fastest ahead of them; then the rejected;
    `progress`: a bar on stderr)."""
    import sys

    from tqdm import tqdm

    constraints = constraints or Constraints.of_run(run)
    planner = Planner(run, device, table, gpus_per_node)
    groups: dict[tuple, list[Layout]] = {}
    for layout in layouts(run, gpus_per_node, constraints):
        groups.setdefault(_base(layout), []).append(layout)
    bar = tqdm(groups.values(), unit="layout", desc=f"layouts of {run.world_size} GPU(s)", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty(), leave=False)
    return rank([_weigh(planner, group, constraints) for group in bar])


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates first, fastest first, but for the first place: the leanest of those within `NEAR`
    of the fastest; then the rejected."""
    ranked = sorted(candidates, key=lambda c: (bool(c.reason), c.hours))
    if ranked and not ranked[0].reason:
        near = [c for c in ranked if not c.reason and c.hours <= ranked[0].hours * (1 + NEAR)]
        lean = min(near, key=lambda c: (c.peak_memory, c.hours))
        ranked.insert(0, ranked.pop(next(i for i, c in enumerate(ranked) if c is lean)))
    return ranked


def _base(layout: Layout) -> tuple:
    """What a candidate keeps in every phase: all of a layout but its cp."""
    return (layout.dp_replicate, layout.ep, layout.micro_batch_size, layout.activation_checkpointing,
            layout.sharding)


def _weigh(planner: Planner, group: list[Layout], constraints: Constraints) -> Candidate:
    """The candidate of one base (a group of layouts that differ in cp only): each phase planned at its fixed cp,
    or at the fastest of the group's cps that fits it."""
    run, device = planner.run, planner.device
    first = group[0]
    phases, cps, searched = [], [], []
    reasons: list[str] = []
    shortfall = 0.0
    micro_problem = _micro_problem(run, first.micro_batch_size)
    for index, phase in enumerate(run.phases):
        fixed = constraints.fixed(index)
        options = [fixed] if fixed is not None else [layout.cp for layout in group if layout.cp <= planner.per_node]
        cps.append(options[0] if options else first.cp)
        searched.append(fixed is None)
        if not planner.schedule[index]:
            continue  # a phase the run never reaches: nothing to choose
        best, leanest, failure = None, None, ""
        for cp in options:
            try:
                mesh = planner.mesh(index, first, cp)
                memory = planner.memory(index, mesh)
            except ZayaError as exc:
                failure = failure or f"phase '{phase.name}': {str(exc).split(': ', 1)[-1]}"
                continue
            if memory.total <= device.memory_bytes:  # only what fits is timed: the rest needs no more than that
                try:
                    planned = planner.phase(index, mesh, memory)
                except ZayaError as exc:  # a batch of the ramp that does not split over its ranks
                    failure = failure or f"phase '{phase.name}': {str(exc).split(': ', 1)[-1]}"
                    continue
                if best is None or planned.seconds < best.seconds:
                    best = planned
            if leanest is None or memory.total < leanest:
                leanest = memory.total
        if best is None and leanest is not None:
            reasons.append(_too_big(phase.name, leanest, device))
            shortfall = max(shortfall, leanest - device.memory_bytes)
        elif best is None:
            reasons.append(failure or f"phase '{phase.name}': no cp of the layout's fits it")
        if best is not None:
            cps[-1] = best.cp
            phases.append(best)
    if micro_problem:
        reasons.append(micro_problem)
    layout = dataclasses.replace(first, cp=cps[0], dp_shard=run.world_size // (first.dp_replicate * cps[0]))
    plan = planner.plan(phases, []) if phases and not reasons else None
    if any(not r.startswith("needs ") for r in reasons):
        shortfall = 0.0  # more than memory keeps it out
    return Candidate(layout, plan, "; ".join(reasons), tuple(cps), tuple(searched), shortfall)


def _micro_problem(run: ResolvedRun, micro: int) -> str:
    """Why the trainer would refuse `micro` sequences per micro-batch ('' if it would not): every batch of the
    ramp splits into whole micro-batches."""
    for size in run.ramp.sizes():
        if size % micro:
            return f"a batch of {size} sequences (the ramp's) does not split into micro-batches of {micro}"
    return ""


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
            best = search_layouts(run, per_node, device, table, constraints=Constraints.of_config(config, run))
            return best[0] if best and not best[0].reason else None
        gpus *= 2
    return None


def describe(candidate: Candidate) -> str:
    layout = candidate.layout
    cps = sorted(set(candidate.phase_cp)) if candidate.phase_cp else [layout.cp]
    cp = f"{layout.cp:>2}" if len(cps) == 1 else "/".join(str(c) for c in candidate.phase_cp)
    return (f"dp_replicate {layout.dp_replicate:>3} x dp_shard {layout.dp_shard:>4} x cp {cp}, "
            f"ep {layout.ep:>2}, {layout.sharding:<5} sharding, micro-batch {layout.micro_batch_size:>2}, "
            f"checkpointing {layout.activation_checkpointing:<4}")
