"""The curriculum's phases as the trainer runs them: the current phase's loader, RoPE base, FLOPs per token and
split of its sequences over a cp group, all set in one place (`Curriculum.enter`), whether the run starts,
resumes, rolls back or moves on to the next phase.

A phase ends once its token budget is spent. A phase of another `cp` needs another mesh: at its boundary the
trainer commits a checkpoint, builds the model, optimizer and loader again on the new mesh and loads that
checkpoint into them (a checkpoint loads on any mesh).

Supervised fine-tuning needs nothing else: a chat dataset's batches carry its loss mask inside the token ids
(`zaya.data.loss_mask`), and `micro_loss` turns the tokens left out into IGNORE_INDEX targets, so the loss (and
the held-out loss, which goes through it too) is the mean over the assistant tokens of each micro-batch. A phase
that keeps documents apart (`isolate_documents`) gives the model each token's position in its document, from the
dataset's eos that ends every document (`zaya.model.documents`), and plans its attention from the micro-batch's
copy on the host, which the trainer keeps, so that nothing is read back from the device. Split over a cp group,
each micro-batch gets a split of its own (`ContextParallel.for_documents`): its chunks (cp x
`parallel.cp_document_chunks`) dealt out to the ranks by their attention work, and attention within documents
(and, in sliding-window blocks, within the window as well: the split plans both).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zaya.data.loader import TokenLoader
from zaya.data.loss_mask import inputs_and_targets, token_ids
from zaya.errors import ZayaError
from zaya.model.documents import Documents, document_positions, packed_documents
from zaya.model.flops import training_flops_per_token
from zaya.model.loss import IGNORE_INDEX
from zaya.model.masks import DocumentLayout
from zaya.model.transformer import RouterStats, Zaya
from zaya.parallel.context import ContextParallel, SequenceLayout
from zaya.parallel.mesh import ParallelContext
from zaya.reading import read_bytes
from zaya.train.checkpointing import Progress
from zaya.train.config import Phase
from zaya.train.run import ResolvedRun


class Curriculum:
    """The phases of `run` and the one being trained (see the module docstring). `allow_data_change` lets a resume
    go on in another order."""

    def __init__(self, run: ResolvedRun, *, allow_data_change: bool = False):
        self.run, self.allow_data_change = run, allow_data_change
        self.loader: TokenLoader | None = None  # the current phase's; None between phases
        self.tokenizer: Path | None = None  # the current phase's tokenizer.json, which checkpoints carry
        self.chat_template: Path | None = None  # and its chat template, where the data are chats
        self.sequence: ContextParallel | None = None  # the cp split of the current phase (None: unsplit)
        self.separator: int | None = None  # the eos that ends each packed document, where the phase keeps them apart
        self.flops_per_token = 0.0

    def phase(self, progress: Progress) -> Phase:
        return self.run.phases[progress.phase]

    def enter(self, progress: Progress, model: Zaya, parallel: ParallelContext, checkpoint: Path | None) -> None:
        """Set everything that follows from the current phase: its loader (where the run left it: `progress`, from
        `checkpoint` if restored, named in messages), its RoPE base, its FLOPs per token and its split of
        sequences."""
        phase = self.phase(progress)
        self.close()
        self.loader = self._loader(progress, parallel, checkpoint)
        if phase.rope_theta:
            model.set_rope_theta(phase.rope_theta)
        self.flops_per_token = training_flops_per_token(self.run.model, phase.seq_len)
        self.sequence = self._sequence(phase, parallel)
        self.separator = self.loader.datasets[0].eos_id if phase.isolate_documents else None

    def _loader(self, progress: Progress, parallel: ParallelContext, checkpoint: Path | None) -> TokenLoader:
        phase, data = self.phase(progress), self.run.data
        loader = TokenLoader([(s.path, s.weight) for s in phase.sources], phase.seq_len, self.run.train.seed,
                             rank=parallel.dp_rank, world_size=parallel.dp_size, block_size=data.block_size,
                             group_blocks=data.group_blocks)
        saved = progress.loaders.get(phase.name)
        if saved is not None:
            try:
                loader.load_state_dict(saved)
            except ZayaError as error:
                if not self.allow_data_change:
                    loader.close()
                    raise ZayaError(f"{checkpoint}: {error}; pass --allow-data-change to continue in this "
                                    "config's order") from None
                loader.load_state_dict({**loader.state_dict(), "consumed_samples": saved["consumed_samples"],
                                        "skip_ranges": saved.get("skip_ranges", [])})
        progress.fingerprints[phase.name] = [d.fingerprint for d in loader.datasets]
        self.tokenizer = loader.datasets[0].tokenizer_path
        try:
            self.chat_template = _chat_template(loader)
        except ZayaError:
            loader.close()
            raise
        return loader

    def tokenizer_files(self) -> list[Path]:
        """The files a checkpoint carries so that it can be run and exported on its own: tokenizer.json and,
        for chat data, chat_template.jinja."""
        return [p for p in (self.tokenizer, self.chat_template) if p is not None]

    def _sequence(self, phase: Phase, parallel: ParallelContext) -> ContextParallel | None:
        """The phase's context-parallel split of every sequence over this rank's cp group (None: unsplit)."""
        if parallel.cp_size == 1:
            return None
        if phase.cp != parallel.cp_size:
            raise ZayaError(f"phase '{phase.name}' needs cp = {phase.cp}, the mesh has {parallel.cp_size}")
        layout = SequenceLayout(phase.seq_len, phase.cp, self.run.parallel.cp_sharding)
        return ContextParallel(layout, parallel.cp_group, self.run.parallel.cp_kernel, parallel.counter)

    def keep_loader_state(self, progress: Progress) -> None:
        """Put the loader's position into the progress (what a checkpoint saves), unless there is none (at a move
        to a new mesh, between the phases' loaders: `advance` kept the last one's)."""
        if self.loader is not None:
            progress.loaders[self.phase(progress).name] = self.loader.state_dict()

    def done_with(self, progress: Progress) -> bool:
        """Whether the current phase's token budget is spent and another phase follows."""
        phase = self.phase(progress)
        return bool(phase.tokens) and progress.phase_tokens >= phase.tokens and progress.phase + 1 < len(
            self.run.phases)

    def advance(self, progress: Progress) -> bool:
        """Leave the current phase for the next, keeping the loader's position; returns whether the next one
        needs another mesh (its cp differs). The caller then enters it (on the new mesh, if so)."""
        before = self.phase(progress)
        self.keep_loader_state(progress)
        self.close()
        progress.phase += 1
        progress.phase_tokens = 0
        return self.phase(progress).cp != before.cp

    def micro_loss(self, model: Zaya, micro: torch.Tensor, stats: RouterStats | None,
                   host: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The next-token loss of the micro-batch `micro` [b, seq_len + 1] (over the tokens its loss mask keeps),
        and the factor its gradient needs. `host`: the same rows on the host, from which a phase that keeps
        documents apart plans its attention (without them they are read back from the device).

        Split over a cp group, each rank's loss is its part of the micro-batch's mean (its tokens' summed
        loss over the micro-batch's valid tokens), so that the parts add up to the unsplit loss; FSDP2
        averages gradients over dp_shard x cp, so the gradient is taken of cp times the part."""
        inputs, targets = inputs_and_targets(micro, IGNORE_INDEX)
        cp, separator = self.sequence, self.separator
        host_ids = None if separator is None else token_ids((micro if host is None else host)[:, :-1].cpu())
        if cp is None:
            documents = None if separator is None else packed_documents(inputs, separator, host_ids=host_ids,
                                                                        window=model.config.active_window)
            return model.loss(inputs, targets, router_stats=stats, documents=documents), 1.0
        valid = targets != IGNORE_INDEX
        documents = None
        if separator is not None:  # this micro-batch's own split, its chunks dealt out by attention work
            positions = document_positions(inputs, separator)
            cp = cp.for_documents(DocumentLayout.from_tokens(host_ids, separator), positions,
                                  chunks_per_rank=self.run.parallel.cp_document_chunks,
                                  window=model.config.active_window)
            documents = Documents(cp.shard(positions), None)
        inputs, targets = cp.shard(inputs), cp.shard(targets)
        share = (targets != IGNORE_INDEX).sum() / valid.sum().clamp_min(1)
        loss = model.loss(inputs, targets, router_stats=stats, sequence=cp, positions=cp.positions(micro.device),
                          documents=documents)
        return loss * share, float(cp.size)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


def _chat_template(loader: TokenLoader) -> Path | None:
    """The chat template of the phase's chat datasets; one, since a model answers in one format."""
    found = {read_bytes(d.chat_template_path, "template"): d.chat_template_path for d in loader.datasets
             if d.chat_template_path is not None}
    if len(found) > 1:
        paths = sorted(str(p) for p in found.values())
        raise ZayaError(f"{paths[1]}: another chat template than {paths[0]}'s; a phase's chat datasets need one")
    return next(iter(found.values()), None)
