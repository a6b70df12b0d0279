"""A run config resolved for one job, once, before anything is built: what the trainer, the planner and the
forecast are made from.

`zaya.config.RunConfig.resolve` derives it (the model config, the phases with their defaults, the batch ramp,
the precision `auto` decided) for a job of `world_size` ranks; `mesh` gives each phase's mesh on it, and
`check_job` that every phase fits it. Every component takes the section it needs from here, and nothing derives
any of it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zaya.data.config import DataSection
from zaya.data.ramp import BatchRamp
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.optim.config import OptimConfig
from zaya.optim.schedule import ScheduleConfig
from zaya.parallel.config import ParallelConfig, ParallelizeConfig, experts_split_problem, sequence_split_problem
from zaya.train.config import BalanceSection, CheckpointSection, LoggingSection, Phase, TrainSection


@dataclass(frozen=True)
class MeshShape:
    """One phase's mesh: (dp_replicate, dp_shard, cp) ranks."""

    dp_replicate: int
    dp_shard: int
    cp: int

    @property
    def dp(self) -> int:
        """Ranks that read different data (context-parallel ranks share theirs)."""
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run is built from, resolved for a job of `world_size` ranks (see the module docstring)."""

    source: str  # the config file, for messages
    world_size: int
    model: ZayaConfig
    phases: tuple[Phase, ...]  # every field filled in: sources, seq_len, cp
    ramp: BatchRamp
    train: TrainSection  # its precision resolved: "bf16" or "fp32", never "auto"
    data: DataSection
    optim: OptimConfig  # Newton-Schulz in fp32 where `auto` chose fp32
    schedule: ScheduleConfig
    balance: BalanceSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    parallel: ParallelConfig
    record: dict[str, Any]  # the run config as resolved: run_config.json, and every checkpoint's copy

    def mesh(self, phase: int) -> MeshShape:
        """Phase `phase`'s mesh on `world_size` ranks, after checking that its batches split over its
        data-parallel ranks and its sequences into its cp chunks (a ZayaError names the key that does not fit)."""
        shape = MeshShape(*self.parallel_of(phase).shape(self.world_size, self.source))
        problem = experts_split_problem(self.model.num_experts, self.parallel.ep)
        if problem:
            raise ZayaError(f"{self.source}: key 'parallel.ep': {problem}")
        cp = shape.cp
        for size in self.ramp.sizes():
            if size % shape.dp:
                key = "train.global_batch_size" if size == self.train.global_batch_size else "data.ramp_start"
                raise ZayaError(f"{self.source}: key '{key}': a global batch of {size} sequences does not divide "
                                f"evenly over the {shape.dp} data-parallel ranks (parallel.dp_replicate "
                                f"x dp_shard, with cp = {cp})")
        if cp > 1:
            configured = self.record.get("phases") or []
            own = phase < len(configured) and configured[phase].get("seq_len")
            key = f"phases.{phase}.seq_len" if own else "data.seq_len"
            seq_len, sharding = self.phases[phase].seq_len, self.parallel.cp_sharding
            # a phase that keeps packed documents apart cuts its sequences into cp x cp_document_chunks chunks
            chunks = self.parallel.cp_document_chunks if self.phases[phase].isolate_documents else None
            problem = sequence_split_problem(seq_len, cp, sharding, min_chunk=self.model.conv_padding,
                                             chunks_per_rank=chunks)
            if problem:
                raise ZayaError(f"{self.source}: key '{key}' = {seq_len} with parallel.cp = {cp} ({sharding} "
                                f"sharding): {problem}")
        return shape

    def check_job(self) -> None:
        """Every phase fits the job (`mesh`), and every batch of the ramp splits into micro-batches."""
        for phase in range(len(self.phases)):
            self.mesh(phase)
        self.ramp.check_divisible(self.train.micro_batch_size, "train.micro_batch_size")

    def parallel_of(self, phase: int) -> ParallelConfig:
        """`[parallel]` with phase `phase`'s context-parallel size."""
        return dataclasses.replace(self.parallel, cp=self.phases[phase].cp)

    @property
    def precision(self) -> str:
        """"bf16" or "fp32": `train.precision` as resolved."""
        return self.train.precision

    @property
    def parallelize(self) -> ParallelizeConfig:
        """What `zaya.parallel.fsdp.parallelize` applies to the model."""
        return ParallelizeConfig(self.train.activation_checkpointing, self.train.compile, self.precision == "bf16",
                                 self.parallel.sharding)
