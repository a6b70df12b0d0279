"""Whether a run fits its device's memory, before it allocates: the plan's prediction against the memory there is,
and, where it does not fit, its largest part and the smallest change of layout that makes it fit.

A run that does not fit would otherwise start, build its model, and be stopped by the device (an out-of-memory
error) or, on a CPU, by the kernel (SIGKILL, no checkpoint, no line). `zaya train` refuses it with this line
(`--allow-over-memory` starts it anyway). The change proposed is found by the layout search of `zaya plan
--search` on the run's own rank count: of the layouts that fit, the one that changes the fewest settings, the
fastest among those; where none does, what else would (more GPUs, shorter sequences, a smaller model).
"""

from __future__ import annotations

from zaya.plan.planner import PhasePlan, Plan, layout_of
from zaya.plan.search import search_layouts
from zaya.train.run import ResolvedRun

GB = 1e9
# the parts of a phase's memory (`zaya.plan.memory.Memory`) named as its largest
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "transient", "communication_buffers",
         "optimizer_workspace")


def largest_part(phase: PhasePlan) -> tuple[str, int]:
    """(name, bytes) of the largest part of a phase's predicted memory."""
    memory = phase.memory.to_dict()
    name = max(PARTS, key=lambda part: memory[part])
    return name.replace("_", " "), memory[name]


def memory_problem(plan: Plan, run: ResolvedRun, table=None, fix: bool = True) -> str | None:
    """One line if `plan` (of `run`, on its device, `table`: the device's measured rates) says the run needs more
    memory than the device has; None if it fits, or if the device's memory is not known. The line names the phase
    that needs the most, its largest part, and (`fix`) the smallest fix (`smallest_fix`)."""
    device = plan.device
    worst = max(plan.phases, key=lambda phase: phase.memory.total)
    if device.memory_bytes <= 0 or worst.memory.total <= device.memory_bytes:
        return None
    part, nbytes = largest_part(worst)
    where = f" in phase '{worst.name}'" if len(plan.phases) > 1 else ""
    have = "available to it" if device.host else f"the {device.name} has"
    return (f"{run.source}: the plan needs {worst.memory.total / GB:.2f} GB per {device.unit}{where} (the largest "
            f"part: {part} {nbytes / GB:.2f} GB), more than the {device.memory_bytes / GB:.2f} GB {have}"
            + (f"; {smallest_fix(plan, run, table)}" if fix else ""))


def smallest_fix(plan: Plan, run: ResolvedRun, table=None) -> str:
    """What makes the run fit, as `--set` overrides: the fitting layout of its rank count that changes the fewest
    settings (the fastest of those), or, if none fits, what else would."""
    device, gpus = plan.device, run.world_size
    per_node = plan.first.layout.gpus_per_node
    own = set(layout_of(run, per_node, 0).settings())
    fitting = [c for c in search_layouts(run, per_node, device, table) if not c.reason]
    if not fitting:
        more = "" if device.host else "more GPUs, "
        return (f"no layout of its {gpus} rank(s) fits: {more}shorter sequences (seq_len) or a smaller model would; "
                f"`zaya plan {run.source} --search` shows the layouts and their memory")
    best = min(fitting, key=lambda c: (len(set(c.layout.settings()) - own), c.hours))
    changes = [setting for setting in best.layout.settings() if setting not in own]
    needs = max(phase.memory.total for phase in best.plan.phases)
    return (f"{' '.join(f'--set {s}' for s in changes)} makes it {needs / GB:.2f} GB "
            f"(`zaya plan {run.source} --search` ranks the layouts that fit)")
