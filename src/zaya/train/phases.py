"""The curriculum's phases as the trainer runs them: each phase's mesh (its context-parallel size), the split
of its sequences over a cp group, and the switch to the next phase.

A phase of another `cp` needs another mesh: at its boundary the trainer commits a checkpoint, builds the
model, optimizer and loader again on the new mesh and loads that checkpoint into them (a checkpoint loads on
any mesh). Part of `Trainer` (a mixin, like `zaya.train.signals`), kept apart so the training loop stays short.
"""

from __future__ import annotations

import dataclasses

import torch

from zaya.config import Phase
from zaya.errors import ZayaError
from zaya.model.flops import training_flops_per_token
from zaya.model.loss import IGNORE_INDEX
from zaya.model.transformer import RouterStats
from zaya.parallel.context import ContextParallel, SequenceLayout
from zaya.parallel.mesh import ParallelConfig


class TrainingPhases:
    """Phases, their meshes and their sequence splits."""

    def _parallel_config(self, phase: Phase) -> ParallelConfig:
        """`[parallel]` with the phase's context-parallel size."""
        return dataclasses.replace(self.config.parallel, cp=phase.cp)

    def _check_phase_meshes(self, ramp) -> None:
        """Every phase's mesh fits the job: its batches split over its data-parallel ranks, its sequences into
        its cp chunks."""
        train, where = self.config.train, self.config.source
        for index, phase in enumerate(self.phases):
            replicate, shard, cp = self._parallel_config(phase).shape(self.launch.world_size, where)
            for size in ramp.sizes():
                if size % (replicate * shard):
                    key = "train.global_batch_size" if size == train.global_batch_size else "data.ramp_start"
                    raise ZayaError(f"{where}: key '{key}': a global batch of {size} sequences does not split "
                                    f"evenly over the {replicate * shard} data-parallel ranks (parallel.dp_replicate "
                                    f"x dp_shard, with cp = {cp})")
            if cp > 1:
                key = f"phases.{index}.seq_len" if self.config.phases and self.config.phases[index].seq_len \
                    else "data.seq_len"
                layout = SequenceLayout(phase.seq_len, cp, self.config.parallel.cp_sharding)
                problem = layout.check(min_chunk=self.model_config.conv_padding)
                if problem:
                    raise ZayaError(f"{where}: key '{key}' = {phase.seq_len} with parallel.cp = {cp} "
                                    f"({self.config.parallel.cp_sharding} sharding): {problem}")

    def _sequence(self, phase: Phase) -> ContextParallel | None:
        """The phase's context-parallel split of every sequence over this rank's cp group (None: unsplit)."""
        if self.parallel.cp_size == 1:
            return None
        if phase.cp != self.parallel.cp_size:
            raise ZayaError(f"phase '{phase.name}' needs cp = {phase.cp}, the mesh has {self.parallel.cp_size}")
        layout = SequenceLayout(phase.seq_len, phase.cp, self.config.parallel.cp_sharding)
        return ContextParallel(layout, self.parallel.cp_group, self.config.parallel.cp_kernel,
                               self.parallel.counter)

    def _micro_loss(self, micro: torch.Tensor, stats: RouterStats | None) -> tuple[torch.Tensor, float]:
        """The next-token loss of the micro-batch `micro` [b, seq_len + 1], and the factor its gradient needs.

        Split over a cp group, each rank's loss is its part of the micro-batch's mean (its tokens' summed
        loss over the micro-batch's valid tokens), so that the parts add up to the unsplit loss; FSDP2
        averages gradients over dp_shard x cp, so the gradient is taken of cp times the part."""
        inputs, targets = micro[:, :-1], micro[:, 1:]
        cp = self.sequence
        if cp is None:
            return self.model.loss(inputs, targets, router_stats=stats), 1.0
        valid = targets != IGNORE_INDEX
        inputs, targets = cp.shard(inputs), cp.shard(targets)
        share = (targets != IGNORE_INDEX).sum() / valid.sum().clamp_min(1)
        loss = self.model.loss(inputs, targets, router_stats=stats, sequence=cp,
                               positions=cp.positions(micro.device))
        return loss * share, float(cp.size)

    def _maybe_switch_phase(self) -> None:
        phase = self.phases[self.state.phase]
        if phase.tokens and self.state.phase_tokens >= phase.tokens and self.state.phase + 1 < len(self.phases):
            self.state.loaders[phase.name] = self.loader.state_dict()
            self.loader.close()
            self.state.phase += 1
            self.state.phase_tokens = 0
            nxt = self.phases[self.state.phase]
            self._say(f"step {self.state.step}: phase '{phase.name}' done after {self.state.tokens:,} tokens; "
                      f"starting '{nxt.name}' (seq_len {nxt.seq_len}"
                      f"{f', rope_theta {nxt.rope_theta:g}' if nxt.rope_theta else ''}"
                      f"{f', cp {nxt.cp}' if nxt.cp != phase.cp else ''})")
            if nxt.cp != phase.cp:
                self._remesh(nxt)
            else:
                self.loader = self._loader(self.state.phase)
                self.sequence = self._sequence(nxt)
            if nxt.rope_theta:
                self.model.set_rope_theta(nxt.rope_theta)
            self.flops_per_token = training_flops_per_token(self.model_config, nxt.seq_len)

    def _remesh(self, phase: Phase) -> None:
        """Start `phase`, whose cp size differs, on a new mesh: commit a checkpoint at the boundary, then
        build the model, optimizer and loader again on the new mesh and load that checkpoint into them (a
        checkpoint loads on any mesh)."""
        self._say(f"step {self.state.step}: phase '{phase.name}' runs with cp = {phase.cp}: checkpointing and "
                  "moving to a new mesh")
        self.save()
        self.manager.wait()
        self.resume_from = self.manager.newest_valid(log=self._say)
        self.start_phase = self.state.phase
        self._build()
        self._say(f"step {self.state.step}: now on {self.parallel.describe()}")
