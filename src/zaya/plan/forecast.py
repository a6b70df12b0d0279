"""The plan beside the run: at startup the trainer prints what `zaya plan` predicts for this run's mesh and
device (memory per GPU or CPU process, step time, throughput), and after 20 steps the measured figures next to
it, so that a wrong prediction is seen at once, and a right one can be trusted for the next launch.

The device is the one the run trains on: a GPU of the device table by its name, or this machine measured by
`zaya shapes` (its table for the run's precision); a CPU without a table gets the memory prediction only. On a
CPU the memory a rank has is the host's available memory shared by the node's ranks (processes).
A prediction that cannot be made never stops training (one line says why); one that says the run does not fit
its memory does, before anything is allocated, unless the user says otherwise (`zaya.plan.fit`).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import torch

from zaya.device import accelerator_name, device_label, is_accelerator, memory_available_bytes
from zaya.errors import ZayaError
from zaya.plan.devices import DeviceSpec, get_device, match_device
from zaya.plan.fit import memory_problem
from zaya.plan.planner import plan_run
from zaya.train.run import ResolvedRun

STEPS = 20  # measured steps before the comparison (the first is left out: it warms up)
GB = 1e9
# a measured step time, or on a GPU a measured peak memory, this far off the plan's is said in a line of its own:
# the plan chose the layout (`parallel.layout = "auto"`) or sized it, and a prediction off by more than this
# could have chosen another
MARGIN = 0.25


class Forecast:
    """The prediction for a run, and what the run measures against it: the trainer calls `start` once, then
    `observe` with every step's metrics row."""

    def __init__(self, plan, note: str = "", on_cpu: bool = False, failure: str = "", run: ResolvedRun | None = None,
                 table=None) -> None:
        self.plan, self.note, self.on_cpu, self.failure = plan, note, on_cpu, failure
        self.run, self.table = run, table  # what the plan is of, for `over_memory`
        self.runner_up = ""  # the prediction of the layout `auto` ranked second, said where this one is off
        self.phase = 0
        self.rows: list[dict] = []
        self.done = plan is None

    @classmethod
    def for_run(cls, run: ResolvedRun, device: torch.device, gpus_per_node: int, table_path: Path,
                cache: Path | None = None) -> Forecast:
        """The forecast of `run` on its ranks of `device`, `gpus_per_node` on a node; `table_path` is where
        `zaya shapes` keeps this machine's table for the run's precision, `cache` the calibrations of
        `zaya plan --calibrate-from`. A prediction that cannot be made is a one-line note, never an error: it
        must not stop a run."""
        try:
            spec, table, note = target(run, device, table_path, gpus_per_node, cache)
            plan = plan_run(run, spec, table, min(gpus_per_node, run.world_size))
        except ZayaError as exc:
            return cls(None, failure=f"plan: no prediction ({exc})")
        except Exception as exc:  # a bug in the prediction is reported, not raised
            return cls(None, failure=f"plan: no prediction ({type(exc).__name__}: {exc})")
        return cls(plan, note, not is_accelerator(device), run=run, table=table)

    def over_memory(self) -> str | None:
        """One line if the plan says the run needs more memory than its device has (`zaya.plan.fit`), naming the
        largest part and the smallest fix; None if it fits or there is no plan."""
        if self.plan is None or self.run is None:
            return None
        try:
            return memory_problem(self.plan, self.run, self.table)
        except Exception:  # the search for a fix failed (a bug, reported by `zaya plan`): the verdict stands alone
            return memory_problem(self.plan, self.run, self.table, fix=False)

    def start(self, phase: int) -> str:
        """The startup message, for a run that starts (or resumes) in `phase`."""
        self.phase = phase
        return self.failure or self.startup()

    def _phase(self):
        return self.plan.phases[min(self.phase, len(self.plan.phases) - 1)]

    def startup(self) -> str:
        phase = self._phase()
        memory = phase.memory
        device = self.plan.device
        text = (f"plan ({device.name}): {memory.total / GB:.2f} GB per {device.unit} (state "
                f"{(memory.parameters + memory.gradients + memory.optimizer_state) / GB:.2f}, activations "
                f"{memory.activations / GB:.2f}, buffers {memory.communication_buffers / GB:.2f}) of "
                f"{device.memory_bytes / GB:.{0 if device.memory_bytes >= 10 * GB else 1}f} GB"
                f"{' available' if device.host else ''}")
        if self.note and not self.note.startswith(" "):
            return f"{text}; {self.note}"
        tokens = phase.batch_tokens / phase.time.total / phase.layout.gpus
        return (f"{text}; step {phase.time.total:.3f} s{self.note}, {tokens:,.0f} tokens/s per {device.unit}, "
                f"{phase.traffic.total / GB:.3f} GB sent per {device.unit} per step; phase '{phase.name}' "
                f"{phase.hours:.1f} h")

    def observe(self, row: dict) -> str | None:
        """Take one step's metrics row; after `STEPS` full-batch steps, the comparison (once)."""
        if self.done:
            return None
        phase = self._phase()
        if row.get("batch_size", 0) * phase.seq_len != phase.batch_tokens or row.get("phase") != phase.name:
            return None  # a ramp step, or another phase: not what was predicted
        self.rows.append(row)
        if len(self.rows) < STEPS + 1:
            return None
        self.done = True
        return self.compare()

    def compare(self) -> str:
        phase = self._phase()
        rows = self.rows[1:]
        seconds = statistics.median(r["step_time"] for r in rows)
        memory = max(max(r["peak_memory_bytes"]) for r in rows)
        sent = statistics.median(max(r["comm_bytes"]) for r in rows)
        tokens = phase.batch_tokens / seconds / phase.layout.gpus
        where = " (the process's resident set: the interpreter and torch included)" if self.on_cpu else ""
        text = (f"measured over steps {rows[0]['step']}-{rows[-1]['step']} against the plan: peak memory "
                f"{memory / GB:.2f} GB{where} (plan {phase.memory.total / GB:.2f}); sent {sent / GB:.3f} GB per step "
                f"(plan {phase.traffic.total / GB:.3f})")
        timed = not self.note or self.note.startswith(" ")
        if timed:
            text += (f"; step {seconds:.3f} s (plan {phase.time.total:.3f}, {phase.time.total / seconds - 1:+.0%}), "
                     f"{tokens:,.0f} tokens/s per {self.plan.device.unit}")
        off = []
        if timed and abs(seconds / phase.time.total - 1) > MARGIN:
            off.append(f"the step takes {seconds:.3f} s, {seconds / phase.time.total - 1:+.0%} off the plan's "
                       f"{phase.time.total:.3f} s")
        if not self.on_cpu and abs(memory / phase.memory.total - 1) > MARGIN:  # a CPU's figure holds the interpreter
            off.append(f"the peak memory is {memory / GB:.2f} GB, {memory / phase.memory.total - 1:+.0%} off the "
                       f"plan's {phase.memory.total / GB:.2f} GB")
        if off:
            text += (f"\nwarning: {' and '.join(off)} (more than the {MARGIN:.0%} the plan is held to)"
                     + (f"; {self.runner_up}" if self.runner_up else "")
                     + "; `zaya plan --calibrate-from RUN_DIR --device NAME` folds this run's figures into the "
                       "device's for the next launch")
        return text


def target(run: ResolvedRun, device: torch.device, table_path: Path, processes: int = 1, cache: Path | None = None):
    """(DeviceSpec, measured table or None, note) for the device the run trains on, `processes` ranks on this node,
    with the calibration `zaya plan --calibrate-from` kept under `cache` (if any). A CPU's memory is what the host
    has available now, shared by those processes. A note that does not start with a space says the spec has no
    figures for time (memory only)."""
    spec, table, note = _target(run, device, table_path, processes)
    if cache is not None and (not note or note.startswith(" ")):
        from zaya.plan.calibration import calibrated

        spec = calibrated(spec, cache, run.precision)
    return spec, table, note


def _target(run: ResolvedRun, device: torch.device, table_path: Path, processes: int = 1):
    from zaya.plan.table import EfficiencyTable

    host = not is_accelerator(device)
    memory = memory_available_bytes(device) // max(1, min(processes, run.world_size)) if host else None
    if table_path.is_file():
        table = EfficiencyTable.load(table_path)
        if table.device.split(":")[0] == device.type:
            ns = "bf16" if run.optim.ns_dtype in ("bfloat16", "bf16") else "fp32"
            caveat = "" if ns == table.dtype else \
                f" (its Newton-Schulz in {ns} is scaled from the {ns} peak: the table measured {table.dtype} GEMMs)"
            spec = get_device("local", table)
            return (dataclasses.replace(spec, memory_bytes=memory, host=True) if host else spec), table, caveat
    name = accelerator_name(device)
    if name is not None:
        spec = match_device(name)
        if spec is not None:  # its published memory, or less where less is visible (a MIG slice)
            visible = memory_available_bytes(device)
            return dataclasses.replace(spec, memory_bytes=min(spec.memory_bytes, visible or spec.memory_bytes)), \
                None, ""
    # no figures for this device: memory alone (its size is known), no time
    spec = DeviceSpec("local", device_label(device), {"bf16": 1.0, "fp32": 1.0},
                      memory if host else memory_available_bytes(device), 1.0, 1.0, 1.0, 1, 1.0, (), host=host)
    return spec, None, f"no step-time prediction: `zaya shapes --dtype {run.precision}` measures this device"
