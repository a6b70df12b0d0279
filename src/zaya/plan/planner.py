"""`plan_run`: a run resolved for a GPU count (`zaya.train.run`), and a device, in; memory per GPU, communication
per step, step time, throughput, MFU and the wall-clock time of every phase out, before anything runs.

The run is the one the trainer would run: every phase on its own mesh (`[parallel]` with the phase's `cp`),
its sequences of `seq_len` tokens, `global_batch_size` sequences per step split over the data-parallel ranks
and cut into micro-batches of `micro_batch_size`; the last phase runs until `train.max_steps`, as the
trainer's does. The batch ramp is followed step by step (in runs of equal batch size, `schedule`): each run
of steps is costed at its own batch, so a phase's hours and tokens are those the trainer would spend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zaya.device import (
    auto_precision,
    compiles_training,
    default_accelerator,
    grouped_mm_row_multiple,
    loss_chunk_logits,
)
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.flops import training_flops_per_token
from zaya.model.params import ParameterReport, parameter_report
from zaya.parallel.config import sequence_split_problem
from zaya.plan.devices import DeviceSpec
from zaya.plan.documents import DocumentPlan, phase_documents
from zaya.plan.inventory import config_key, forget_keys
from zaya.plan.layout import Layout, check_batch, expert_parallel_problem
from zaya.plan.memory import MODES, DeviceDetails, Memory, activation_bytes, decode_cache_bytes, memory_per_gpu
from zaya.plan.timing import Rates, RooflineRates, StepTime, step_time
from zaya.plan.traffic import Traffic, step_traffic
from zaya.train.run import ResolvedRun

# measured collective bandwidth is below the links' peak: NCCL/RCCL bus bandwidth reaches about this fraction
COLLECTIVE_EFFICIENCY = 0.8


@dataclass
class PhasePlan:
    """One phase as it would run."""

    name: str
    seq_len: int
    cp: int
    layout: Layout
    steps: int
    tokens: int
    micro_batches: int
    memory: Memory
    traffic: Traffic
    time: StepTime
    mode_activations: Callable[[], dict[str, int]]  # `activations_by_mode`, worked out when asked
    fits: bool
    seconds: float = 0.0  # all its steps, each at its batch size
    batch_tokens: int = 0  # tokens of one step at the full batch (what `time` is the time of)
    documents: DocumentPlan | None = None  # the packed documents it keeps apart (None: causal over whole rows)
    decode_cache: int = 0  # bytes of one sequence's decode cache at `seq_len` (`memory.decode_cache_bytes`)

    @property
    def hours(self) -> float:
        return self.seconds / 3600

    @functools.cached_property
    def activations_by_mode(self) -> dict[str, int]:
        """Activation bytes per checkpointing mode (`zaya.plan.memory.MODES`)."""
        return self.mode_activations()

    def to_dict(self) -> dict:
        return {"name": self.name, "seq_len": self.seq_len, "cp": self.cp, "steps": self.steps, "tokens": self.tokens,
                "hours": self.hours, "micro_batches": self.micro_batches, "step_time_s": self.time.total,
                "memory_per_gpu": self.memory.to_dict(), "fits": self.fits,
                "comm_bytes_per_step": {k: int(v) for k, v in self.traffic.by_kind.items()},
                "activations_by_checkpointing": self.activations_by_mode,
                "documents": None if self.documents is None else self.documents.to_dict(),
                "decode_cache_per_sequence": self.decode_cache}


@dataclass
class Plan:
    """The prediction for a run; `phases[0]` is the one the headline figures describe."""

    source: str
    device: DeviceSpec
    precision: str
    params: ParameterReport
    flops_per_token: float
    phases: list[PhasePlan]
    peak_flops: float
    bandwidths: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # phases that cannot run on this layout, and why
    sliding: dict | None = None  # {"blocks", "of", "window"}: the blocks that attend within a window; None: none

    @property
    def first(self) -> PhasePlan:
        return self.phases[0]

    @property
    def fits(self) -> bool:
        return not self.problems and all(phase.fits for phase in self.phases)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        phase = self.first
        return phase.batch_tokens / phase.time.total / phase.layout.gpus

    @property
    def hours(self) -> float:
        return sum(phase.hours for phase in self.phases)

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.flops_per_token / self.peak_flops

    def to_dict(self) -> dict:
        first = self.first
        return {
            "config": self.source,
            "device": self.device.name,
            "gpus": first.layout.gpus,
            "gpus_per_node": first.layout.gpus_per_node,
            "layout": dataclasses.asdict(first.layout),
            "precision": self.precision,
            "params_total": self.params.total,
            "params_active": self.params.active,
            "params_embedding": self.params.embedding,
            "flops_per_token": self.flops_per_token,
            "memory_per_gpu": first.memory.to_dict(),
            "device_memory": self.device.memory_bytes,
            "fits": self.fits,
            "comm_bytes_per_step": {k: int(v) for k, v in first.traffic.by_kind.items()},
            "comm_bytes_per_step_by_dimension": {k: int(v) for k, v in first.traffic.by_dimension().items()},
            "bandwidths": self.bandwidths,
            "step_time_s": first.time.total,
            "step_time_parts_s": first.time.to_dict(),
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "phases": [phase.to_dict() for phase in self.phases],
            "hours": self.hours,
            "problems": list(self.problems),
            "sliding": self.sliding,
        }


_REPORTS: dict[str, ParameterReport] = {}


def _parameter_report(config: ZayaConfig) -> ParameterReport:
    """The report of `config`, remembered by its fields (`repr`, cheaper than the JSON a layout search would
    otherwise write twice per layout)."""
    key = config_key(config)
    if key not in _REPORTS:
        if len(_REPORTS) >= 16:
            _REPORTS.clear()
        _REPORTS[key] = _cached_report(json.dumps(config.to_dict(), sort_keys=True))
    return _REPORTS[key]


@functools.lru_cache(maxsize=16)
def _cached_report(key: str) -> ParameterReport:
    return parameter_report(ZayaConfig(**json.loads(key)))


def device_details(device: DeviceSpec, table_device: str | None, precision: str) -> DeviceDetails:
    """The model code's per-device choices (`zaya.device`) for the device planned for."""
    torch_device = torch.device(table_device) if table_device else default_accelerator()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return DeviceDetails(row_multiple=grouped_mm_row_multiple(torch_device, dtype),
                         loss_chunk_logits=loss_chunk_logits(torch_device))


def rates_for(device: DeviceSpec, table=None) -> Rates:
    """The measured table if there is one, else the roofline of the device's published figures."""
    if table is not None:
        return table
    return RooflineRates(device.peak_flops, device.memory_bandwidth, device.gemm_efficiency)


def layout_of(run: ResolvedRun, gpus_per_node: int, phase: int) -> Layout:
    """The `Layout` the run's `[parallel]` gives phase `phase` on its GPUs."""
    mesh = run.mesh(phase)
    return Layout(run.world_size, gpus_per_node, mesh.dp_replicate, mesh.dp_shard, mesh.cp, run.train.micro_batch_size,
                  run.train.activation_checkpointing, bool(run.train.compile), run.parallel.sharding, run.parallel.ep)


def bandwidths_for(layout: Layout, device: DeviceSpec) -> dict[str, float]:
    """Bytes/s per mesh dimension: scale-up links inside a node, the network across nodes."""
    intra, inter = (b * COLLECTIVE_EFFICIENCY for b in (device.intra_node_bandwidth, device.inter_node_bandwidth))
    if layout.gpus_per_node == 1:
        intra = inter
    C, S, ep = layout.cp, layout.dp_shard, layout.ep
    spans = {"cp": layout.spans_nodes(C, 1), "dp_shard_cp": layout.spans_nodes(S * C, 1),
             "dp_replicate": layout.spans_nodes(layout.dp_replicate, S * C),
             "world": layout.gpus > layout.gpus_per_node}
    if ep > 1:  # the token exchange's consecutive ranks, and the ranks ep apart that shard the same experts
        spans.update(ep=layout.spans_nodes(ep, 1), edp=layout.spans_nodes(S * C // ep, ep))
    return {dim: (inter if crosses else intra) for dim, crosses in spans.items()}


def plan_phase(run: ResolvedRun, layout: Layout, seq_len: int, device: DeviceSpec, rates: Rates,
               details: DeviceDetails, name: str = "main", global_batch: int | None = None,
               documents: DocumentPlan | None = None, memory: Memory | None = None) -> PhasePlan:
    """The `PhasePlan` of one step of `global_batch` sequences (default: the full batch) of `seq_len` tokens
    under `layout`; `documents`: the packed documents the phase keeps apart, if it does; `memory`: its memory per
    GPU where the caller has it already (`Planner.memory`)."""
    model, precision = run.model, run.precision
    step = _Step(run, layout, seq_len, global_batch, documents)
    layout, isolated, chunks = step.layout, documents is not None, step.chunks
    memory = memory or step.memory(device, details)
    tokens = layout.micro_batch_size * seq_len // layout.cp

    def by_mode() -> dict[str, int]:  # for the report only: asked of one plan, not of every layout searched
        return {mode: round(activation_bytes(model, tokens, seq_len, layout.cp, precision, mode, details,
                                             layout.ep, isolated, chunks)[0] * device.memory_factor)
                for mode in MODES}

    traffic, time = step.costs(device, rates, details)
    return PhasePlan(name, seq_len, layout.cp, layout, 0, 0, step.micro_batches, memory, traffic, time, by_mode,
                     memory.total <= device.memory_bytes, batch_tokens=step.global_batch * seq_len,
                     documents=documents, decode_cache=decode_cache_bytes(model, seq_len, 1, precision))


def step_seconds(run: ResolvedRun, layout: Layout, seq_len: int, device: DeviceSpec, rates: Rates,
                 details: DeviceDetails, global_batch: int, documents: DocumentPlan | None = None) -> float:
    """The predicted seconds of one step of `global_batch` sequences (a step of the batch ramp): `plan_phase`'s
    time, without its memory."""
    return _Step(run, layout, seq_len, global_batch, documents).costs(device, rates, details)[1].total


class _Step:
    """One step's split: its micro-batches on `layout`, and its chunks of a split sequence."""

    def __init__(self, run: ResolvedRun, layout: Layout, seq_len: int, global_batch: int | None,
                 documents: DocumentPlan | None):
        parallel = run.parallel
        self.run, self.seq_len, self.documents = run, seq_len, documents
        self.global_batch = global_batch or run.train.global_batch_size
        check_batch(self.global_batch, layout, "train.global_batch_size", run.source)
        per_rank = self.global_batch // layout.dp
        micro = min(layout.micro_batch_size, per_rank)
        self.layout = dataclasses.replace(layout, micro_batch_size=micro)
        self.micro_batches = math.ceil(per_rank / micro)
        # a split sequence's chunks per rank: head-tail's 2, contiguous's 1, or packed documents' own deal
        self.chunks = 1 if parallel.cp_sharding != "headtail" else \
            parallel.cp_document_chunks if documents is not None else 2

    def memory(self, device: DeviceSpec, details: DeviceDetails) -> Memory:
        """Memory per GPU of the step, scaled by the device's calibration."""
        run = self.run
        return memory_per_gpu(run.model, self.layout, self.seq_len, run.precision, run.optim.ns_dtype, details,
                              micro_batches=self.micro_batches, documents=self.documents is not None,
                              cp_chunks=self.chunks).scaled(device.memory_factor)

    def costs(self, device: DeviceSpec, rates: Rates, details: DeviceDetails) -> tuple[Traffic, StepTime]:
        """(bytes sent, seconds) of the step; the seconds scaled by the device's calibration."""
        run, layout, optim, parallel = self.run, self.layout, self.run.optim, self.run.parallel
        traffic = step_traffic(run.model, layout, self.seq_len, run.precision, self.micro_batches, optim.ns_dtype,
                               parallel.cp_kernel, parallel.cp_sharding, self.chunks)
        time = step_time(run.model, layout, self.seq_len, run.precision, self.micro_batches, rates, traffic,
                         bandwidths_for(layout, device), optim.ns_dtype, optim.ns_steps, parallel.cp_kernel, details,
                         self.documents, self.chunks)
        return traffic, time.scaled(device.compute_factor)


def schedule(run: ResolvedRun) -> list[list[tuple[int, int]]]:
    """Per phase, its steps as runs of (batch size, steps), as the trainer takes them: a phase ends once its
    token budget is spent (the last one at `train.max_steps`), the batch follows the ramp."""
    ramp, phases = run.ramp, run.phases
    samples, steps_left, result = 0, run.train.max_steps, []
    for index, phase in enumerate(phases):
        last = index == len(phases) - 1
        runs: list[tuple[int, int]] = []
        tokens = 0
        while steps_left > 0 and (last or not phase.tokens or tokens < phase.tokens):
            batch = ramp.at(samples)
            steps = steps_left
            if ramp.increments and samples <= ramp.ramp_samples:  # the ramp moves at its next threshold
                stage = samples * ramp.increments // ramp.ramp_samples
                change = min(-(-(stage + 1) * ramp.ramp_samples // ramp.increments), ramp.ramp_samples + 1)
                steps = min(steps, max(1, -(-(change - samples) // batch)))
            if phase.tokens and not last:
                steps = min(steps, -(-(phase.tokens - tokens) // (batch * phase.seq_len)))
            if runs and runs[-1][0] == batch:
                runs[-1] = (batch, runs[-1][1] + steps)
            else:
                runs.append((batch, steps))
            samples += steps * batch
            tokens += steps * batch * phase.seq_len
            steps_left -= steps
        result.append(runs)
    return result


def plan_precision(device_name: str) -> str:
    """`train.precision = "auto"` on the device of that name: bf16 on a GPU; on this machine (`local`) what the
    trainer picks."""
    return auto_precision(torch.device("cpu")) if device_name == "local" else "bf16"


def plan_compile(device_name: str, table=None) -> bool:
    """`train.compile = "auto"` on the device of that name: on for a GPU; on this machine (`local`) what the
    trainer picks on the device its table measured (on a CPU: off)."""
    if device_name != "local":
        return True
    return compiles_training(torch.device(table.device) if table is not None else default_accelerator())


class Planner:
    """Plans the phases of one run on one device, phase by phase: `plan_run` for a whole run in one layout, the
    layout search (`zaya.plan.search`) for each phase in many, the run's schedule and the device's rates worked
    out once."""

    def __init__(self, run: ResolvedRun, device: DeviceSpec, table=None, gpus_per_node: int | None = None):
        if run.world_size < 1:
            raise ZayaError(f"--gpus must be at least 1, got {run.world_size}")
        forget_keys()  # a config object may have changed since the last plan
        self.per_node = gpus_per_node or min(device.gpus_per_node, run.world_size)
        if self.per_node < 1:
            raise ZayaError(f"--gpus-per-node must be at least 1, got {self.per_node}")
        self.run, self.device, self.table = run, device, table
        self.rates = rates_for(device, table)
        self.details = device_details(device, getattr(table, "device", None), run.precision)
        self.schedule = schedule(run)

    def mesh(self, index: int, layout: Layout | None = None, cp: int | None = None) -> Layout:
        """Phase `index`'s mesh: the run's own (`layout` None), or `layout`'s with context parallelism `cp` (None:
        the phase's own cp if it has one, else the layout's); a ZayaError says why it cannot run."""
        run, gpus, phase = self.run, self.run.world_size, self.run.phases[index]
        if layout is None:
            mesh = layout_of(run, self.per_node, index)
        else:
            if cp is None:
                cp = phase.cp if phase.cp != run.parallel.cp else layout.cp
            if gpus % (layout.dp_replicate * cp):
                raise ZayaError(f"{run.source}: cp = {cp} x dp_replicate = {layout.dp_replicate} does not "
                                f"divide {gpus} GPUs")
            mesh = dataclasses.replace(layout, gpus=gpus, gpus_per_node=self.per_node, cp=cp,
                                       dp_shard=gpus // (layout.dp_replicate * cp))
        problem = expert_parallel_problem(run.model.num_experts, mesh)
        if problem:
            raise ZayaError(f"{run.source}: {problem}")
        if layout is not None and mesh.cp > 1:  # the run's own mesh was checked by `run.mesh`; this one is new
            chunks = run.parallel.cp_document_chunks if phase.isolate_documents else None
            problem = sequence_split_problem(phase.seq_len, mesh.cp, run.parallel.cp_sharding,
                                             min_chunk=run.model.conv_padding, chunks_per_rank=chunks)
            if problem:
                raise ZayaError(f"{run.source}: seq_len {phase.seq_len} over cp = {mesh.cp}: {problem}")
        return mesh

    def memory(self, index: int, mesh: Layout) -> Memory:
        """Phase `index`'s memory per GPU on `mesh` (what `phase` predicts of it, without the time)."""
        phase = self.run.phases[index]
        return _Step(self.run, mesh, phase.seq_len, None, phase_documents(phase, index, phase.seq_len)).memory(
            self.device, self.details)

    def phase(self, index: int, mesh: Layout, memory: Memory | None = None) -> PhasePlan | None:
        """Phase `index` on `mesh`, every step of it at its batch size; None for a phase with no steps. `memory`:
        what `memory` gave for it, if the caller asked already."""
        run, phase, runs = self.run, self.run.phases[index], self.schedule[index]
        if not runs:
            return None
        full = run.train.global_batch_size
        documents = phase_documents(phase, index, phase.seq_len)
        planned = plan_phase(run, mesh, phase.seq_len, self.device, self.rates, self.details, phase.name,
                             documents=documents, memory=memory)
        seconds = {batch: step_seconds(run, mesh, phase.seq_len, self.device, self.rates, self.details, batch,
                                       documents)
                   for batch in {batch for batch, _ in runs} - {full}}
        seconds[full] = planned.time.total
        planned.steps = sum(steps for _, steps in runs)
        planned.tokens = sum(batch * steps for batch, steps in runs) * phase.seq_len
        planned.seconds = sum(seconds[batch] * steps for batch, steps in runs)
        return planned

    def plan(self, phases: list[PhasePlan], problems: list[str]) -> Plan:
        """The `Plan` of these phase plans (the first one's figures are the headline's)."""
        run, device, model = self.run, self.device, self.run.model
        peak = device.peak_flops.get(run.precision, device.peak_flops["bf16"])
        if self.table is not None:
            peak = self.table.peak(run.precision)
        sliding = {"blocks": model.sliding_blocks, "of": model.num_hidden_layers, "window": model.sliding_window} \
            if model.sliding_blocks else None
        report = _parameter_report(model)
        return Plan(run.source, device, run.precision, report,
                    training_flops_per_token(model, phases[0].seq_len, report), phases, peak,
                    bandwidths_for(phases[0].layout, device), problems, sliding)


def plan_run(run: ResolvedRun, device: DeviceSpec, table=None, gpus_per_node: int | None = None,
             layout: Layout | None = None, phase_cp: tuple[int, ...] | None = None) -> Plan:
    """The `Plan` of `run` on its `world_size` GPUs of `device` (`table`: its measured GEMM rates, if any);
    `layout` replaces the run's mesh, micro-batch and checkpointing in every phase (cp: `phase_cp`'s for each
    phase where given, as a search's candidate has it; else the phase's own if it has one, else the layout's)."""
    planner = Planner(run, device, table, gpus_per_node)
    gpus = run.world_size
    if layout is not None and layout.dp_replicate * layout.dp_shard * layout.cp != gpus:
        raise ZayaError(f"{run.source}: dp_replicate x dp_shard x cp = {layout.dp_replicate} x "
                        f"{layout.dp_shard} x {layout.cp} is not {gpus} GPUs")
    phases, problems = [], []
    for index, phase in enumerate(run.phases):
        if not planner.schedule[index]:
            continue
        try:
            mesh = planner.mesh(index, layout, phase_cp[index] if layout is not None and phase_cp else None)
        except ZayaError as exc:
            if not phases:
                raise
            problems.append(f"phase '{phase.name}': {str(exc).split(': ', 1)[-1]}")
            continue
        phases.append(planner.phase(index, mesh))
    return planner.plan(phases, problems)
