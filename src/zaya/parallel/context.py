"""Context parallelism: one sequence split over the `cp` ranks of a process group (spec section 9.1).

The sequence of S tokens is cut into chunks of equal length. Head-tail (zigzag) sharding cuts 2 cp chunks
and gives rank r chunks r and 2 cp - 1 - r, so that under the causal mask every rank has the same attention
work (an early chunk, cheap, with a late one, dear); contiguous sharding (cp chunks, rank r holds chunk r)
is there for debugging and for decoding, where the newest tokens must sit on one rank. A rank's tokens are
its chunks in order, each a contiguous run of the global sequence ("segment"), with their global positions
for RoPE.

CCA reaches back across a chunk's start in two places: its causal convolutions need the last P packed
vectors p of the chunk that logically precedes it, and the value shift needs that chunk's last W_vdel x.
`ContextParallel.exchange_halo` brings them from whichever rank holds the preceding chunk (one
all-to-all per layer, and its mirror image for the gradients); the first chunk gets zeros, exactly the
left padding of an unsharded sequence. The halo crosses a chunk's start whatever lies there; where packed
documents are kept apart, the layer masks it with each token's position in its document, as it masks the reach
of its convolutions and value shift on one device, so that a document's first token sees no halo.

Packed documents kept apart: `ContextParallel.for_documents` splits one micro-batch whose rows hold several
documents. Its attention runs, for every pair of chunks, the segments of the document mask
(`zaya.model.masks.DocumentLayout.segments`): a document that crosses a chunk or rank boundary is exact, and a
pair of chunks that shares no document costs nothing. With more than two chunks per rank the chunks are dealt
out by that work (`SequenceLayout.balanced`), since head-tail's pairs balance the causal mask, not documents.
The attention kernels are in `zaya.parallel.cp_attention`.

Sliding-window blocks (`attention(q, k, v, window)`) reach back W - 1 keys from each query: where that fits in
the chunk before, the keys and values cross a chunk's start as the convolutions' halo does (`pass_tails`, the
halo kernel of `zaya.parallel.cp_window`); a longer window runs the kernels above with the window in their plan.
A split keeps one plan per (rows, device, window).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.errors import ZayaError
from zaya.model.masks import DocumentLayout
from zaya.model.packed_attention import in_autocast_dtype
from zaya.parallel.comm import CommCounter, all_to_all_single
from zaya.parallel.config import sequence_split_problem
from zaya.parallel.document_balance import chunk_work, deal


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence of `length` tokens is split over `ranks` ranks (see the module docstring).

    `assignment`, where given, names the chunks of every rank: ranks x K chunks of equal length, K on each rank,
    ascending, every chunk once. `balanced` deals them out by the attention work of a micro-batch's packed
    documents (`zaya.parallel.document_balance`); a rank's tokens are still its chunks in order. Without it,
    `sharding` says (head-tail or contiguous)."""

    length: int
    ranks: int
    sharding: str = "headtail"
    assignment: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def balanced(cls, length: int, ranks: int, documents: DocumentLayout, chunks_per_rank: int) -> SequenceLayout:
        """`length` tokens cut into ranks x `chunks_per_rank` chunks, dealt out so that every rank computes
        about the same attention work for the rows of `documents` (largest chunk first, to the least loaded
        rank that still needs one; then swaps that lower the busiest rank). Deterministic: every rank of a cp
        group plans the same layout from the same documents. Runs on the host, in under a millisecond for four
        rows of 131,072 tokens over 8 x 8 chunks."""
        if documents.length != length:
            raise ZayaError(f"documents of rows of {documents.length} tokens for a sequence of {length}")
        problem = sequence_split_problem(length, ranks, "headtail", chunks_per_rank=chunks_per_rank)
        if problem:
            raise ZayaError(problem)
        return cls(length, ranks, "headtail", deal(chunk_work(documents, ranks * chunks_per_rank), ranks))

    @property
    def num_chunks(self) -> int:
        if self.assignment is not None:
            return self.ranks * len(self.assignment[0])
        return 2 * self.ranks if self.sharding == "headtail" else self.ranks

    @property
    def chunk_len(self) -> int:
        return self.length // self.num_chunks

    def check(self, min_chunk: int = 1) -> str | None:
        """What is wrong with this layout (None if nothing): `zaya.parallel.config.sequence_split_problem`, and
        an assignment that is not K ascending chunks on each rank, every chunk once."""
        if self.assignment is None:
            return sequence_split_problem(self.length, self.ranks, self.sharding, min_chunk)
        per_rank = len(self.assignment[0]) if self.assignment else 0
        if len(self.assignment) != self.ranks or per_rank < 1 or any(len(c) != per_rank for c in self.assignment):
            return (f"an assignment of chunks to {self.ranks} ranks must name the same number of chunks (at least "
                    f"one) for each, got {[len(c) for c in self.assignment]}")
        if any(list(c) != sorted(set(c)) for c in self.assignment):
            return f"each rank's chunks must be ascending, got {self.assignment}"
        if sorted(c for chunks in self.assignment for c in chunks) != list(range(self.num_chunks)):
            return f"an assignment must hold each of the chunks 0 .. {self.num_chunks - 1} once, got {self.assignment}"
        return sequence_split_problem(self.length, self.ranks, "headtail", min_chunk, chunks_per_rank=per_rank)

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks rank `rank` holds, in the order its tokens are laid out."""
        if self.assignment is not None:
            return self.assignment[rank]
        if self.sharding == "headtail":
            return (rank, 2 * self.ranks - 1 - rank)
        return (rank,)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot): who holds `chunk`, and where among its chunks."""
        if self.assignment is not None:
            return self._owners[chunk]
        if self.sharding == "contiguous":
            return chunk, 0
        return (chunk, 0) if chunk < self.ranks else (2 * self.ranks - 1 - chunk, 1)

    @functools.cached_property
    def _owners(self) -> dict[int, tuple[int, int]]:
        return {chunk: (rank, slot) for rank, chunks in enumerate(self.assignment) for slot, chunk in enumerate(chunks)}

    def positions(self, rank: int, device: torch.device | str = "cpu") -> Tensor:
        """The global positions of rank `rank`'s tokens [S / cp], in its layout."""
        L = self.chunk_len
        return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in self.chunks(rank)])

    def shard(self, tensor: Tensor, rank: int, dim: int = 1) -> Tensor:
        """Rank `rank`'s part of a tensor whose dimension `dim` is the sequence."""
        L = self.chunk_len
        return torch.cat([tensor.narrow(dim, c * L, L) for c in self.chunks(rank)], dim=dim)

    def unshard(self, shards: list[Tensor], dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (`shards[r]` from rank r)."""
        L = self.chunk_len
        pieces = [None] * self.num_chunks
        for rank, shard in enumerate(shards):
            for slot, chunk in enumerate(self.chunks(rank)):
                pieces[chunk] = shard.narrow(dim, slot * L, L)
        return torch.cat(pieces, dim=dim)


class ContextParallel:
    """This rank's part of one sequence split over `group`: the `SequenceShard` that
    `zaya.model.attention.CompressedConvAttention` takes (segments, positions, the halo, attention).

    `kernel` is "allgather" or "ring" (`zaya.parallel.cp_attention`). `counter` counts the bytes sent;
    `attention_work` counts the query-key pairs the attention computed (`zaya.model.masks.segment_work` of the
    segments it ran), those of the micro-batches split by `for_documents` included. Without packed documents
    every row is one document: the causal mask."""

    def __init__(self, layout: SequenceLayout, group, kernel: str = "allgather",
                 counter: CommCounter | None = None):
        from zaya.parallel.cp_attention import KERNELS

        if kernel not in KERNELS:
            raise ZayaError(f"parallel.cp_kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.layout, self.group, self.kernel, self.counter = layout, group, kernel, counter
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.size != layout.ranks:
            raise ZayaError(f"a sequence layout for {layout.ranks} ranks on a group of {self.size}")
        self.chunk_ids = layout.chunks(self.rank)
        self.attention_work = 0
        self.documents: DocumentLayout | None = None  # packed documents (`for_documents`); None: one per row
        self._base: ContextParallel | None = None  # whose `attention_work` this one's adds to
        self._plans: dict = {}  # (batch, device, window) -> the attention's `PairPlan` or `WindowPlan`
        self._first: Tensor | None = None  # with packed documents: where each local token's document starts
        self._halo_plan = _halo_plan(layout, self.rank)
        # collectives inside: a compiled block calls it eagerly. Wrapped here rather than decorated, since
        # `torch.compiler.disable` imports the compiler (most of a second) and a run without cp needs none.
        self.exchange_halo = torch.compiler.disable(self._exchange_halo)

    def for_documents(self, documents: DocumentLayout, positions: Tensor, chunks_per_rank: int = 2,
                      window: int | None = None) -> ContextParallel:
        """The split of one micro-batch of packed documents over the same group, kernel and counter, whose
        attention keeps the documents apart: a query sees the keys of its own document only, and a pair of
        chunks that shares no document is not computed.

        `documents`: where each row's documents start (host-side, `DocumentLayout.from_tokens` of the
        micro-batch's input ids; its sliding window, if any, is that of `attention` called without one).
        `window`: the model's sliding window (`ZayaConfig.active_window`), whose plan is made here too, so that
        the sliding blocks see the same documents within it. `positions` [B, T]: each
        token's position in its document, on the device (`zaya.model.documents.document_positions`); the
        model takes this shard's part of them (`shard(positions)`) as its `Documents.positions`.
        `chunks_per_rank`: 2 keeps this layout (head-tail's pairs of chunks, or contiguous's one chunk); more
        cuts the sequence into ranks x chunks_per_rank chunks dealt out by their attention work
        (`SequenceLayout.balanced`, head-tail sharding only). The result's `shard` and `positions` are those of
        its layout; its attention work also counts in this object's `attention_work`."""
        length = self.layout.length
        if documents.length != length:
            raise ZayaError(f"packed documents in rows of {documents.length} tokens on a split sequence of {length}")
        if tuple(positions.shape) != (documents.batch, length):
            raise ZayaError(f"document positions of shape {tuple(positions.shape)} for {documents.batch} rows of "
                            f"{length} tokens")
        if chunks_per_rank < 1:
            raise ZayaError(f"chunks per rank must be at least 1, got {chunks_per_rank}")
        layout = self.layout
        if chunks_per_rank > 2 and layout.sharding == "headtail":
            layout = SequenceLayout.balanced(length, self.size, documents, chunks_per_rank)
        part = ContextParallel(layout, self.group, self.kernel, self.counter)
        part.documents, part._base = documents, self
        # where each local query's document starts, in global indices: what a MASKED segment's mask reads
        part._first = part.shard(torch.arange(length, device=positions.device) - positions)
        # the full blocks' plan and, where the model has any, the sliding blocks': made here, not in the forward
        for planned in dict.fromkeys((None, window)):
            part.attention_plan(documents.batch, positions.device, planned)
        return part

    @property
    def segments(self) -> int:
        """Contiguous runs of the global sequence among this rank's tokens."""
        return len(self.chunk_ids)

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        return self.layout.positions(self.rank, device)

    def shard(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-sequence tensor (token ids, targets, positions in documents)."""
        return self.layout.shard(tensor, self.rank, dim)

    def attention_plan(self, batch: int, device: torch.device | str, window: int | None = None):
        """The segments the attention runs for a batch of `batch` rows on `device` under a sliding `window`
        (None: the documents' own, if any): the halo kernel's `cp_window.WindowPlan` where the window's reach
        fits in the chunk before, else the all-gather and ring kernels' `cp_attention.PairPlan`; of the causal
        mask, or of this micro-batch's documents. Planned on first use, once per (batch, device, window)."""
        device = torch.device(device)
        if window is None and self.documents is not None:
            window = self.documents.window
        plan = self._plans.get((batch, device, window))
        if plan is None:
            if self.documents is not None and (batch, device) != (self.documents.batch, self._first.device):
                raise ZayaError(f"attention over {batch} rows on {device} with packed documents planned for "
                                f"{self.documents.batch} rows on {self._first.device}")
            plan = self._plans[(batch, device, window)] = self._plan(batch, device, window)
        return plan

    def _plan(self, batch: int, device: torch.device, window: int | None):
        from zaya.parallel.cp_attention import PairPlan
        from zaya.parallel.cp_window import WindowPlan, halo_fits

        if self.documents is None:  # one document per row: the same segments for every row (row -1), whose
            starts = ((0,),) * batch  # documents all start at 0
            first = torch.zeros(1, 0, dtype=torch.long, device=device)  # no document starts: masks by shape
        else:
            starts, first = self.documents.starts, self._first
        documents = DocumentLayout(starts, self.layout.length, window)
        if window is not None and halo_fits(window, self.layout.chunk_len):
            return WindowPlan(self.layout, self.rank, documents, first, batch)
        return PairPlan(self.layout, self.rank, documents, first, batch)

    def count_work(self, pairs: int) -> None:
        """Add query-key pairs computed to `attention_work`, here and in the object this one was split from."""
        cp = self
        while cp is not None:
            cp.attention_work += pairs
            cp = cp._base

    def _exchange_halo(self, tails: Tensor) -> Tensor:
        """`tails` [B, segments, n]: what each of this rank's segments ends with. Returns [B, segments, n]:
        what the segment logically preceding each of them ends with (zeros before the first chunk)."""
        return _HaloExchange.apply(tails, self)

    def pass_tails(self, tails: Tensor, kind: str, reverse: bool = False) -> Tensor:
        """`tails` [B, segments, n]: what each of this rank's segments ends with, to the rank holding the chunk
        after it; returns [B, segments, n], what the chunk before each segment ends with (zeros before the
        first). `reverse`: the way back, each segment's row to the chunk before it (zeros from the last).
        One `all_to_all_single`, counted under `kind`; not differentiable (the kernels call it both ways)."""
        plan = self._halo_plan
        if reverse:
            return _route(tails, self, plan.recv_slots, plan.recv_splits, plan.send_slots, plan.send_splits, kind)
        return _route(tails, self, plan.send_slots, plan.send_splits, plan.recv_slots, plan.recv_splits, kind)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        """Causal attention of this rank's queries [B, Hq, T, d] over the whole sequence's keys and values,
        of which this rank holds k, v [B, Hk, T, d]; with packed documents, within each query's document;
        with a sliding `window` W (None: the documents' own, if any), over the last W positions only. A window
        whose W - 1 keys before a chunk lie in the chunk before it runs the halo kernel
        (`zaya.parallel.cp_window`); a longer one the all-gather or ring kernel with the window in its plan."""
        from zaya.parallel.cp_attention import context_attention

        return context_attention(*in_autocast_dtype(q, k, v), self, window)


@dataclass(frozen=True)
class _HaloPlan:
    send_slots: list[int]  # my slots whose tails others need, ordered by (destination rank, their slot)
    send_splits: list[int]  # how many of them go to each rank
    recv_slots: list[int]  # my slots that receive a halo, ordered by (source rank, my slot)
    recv_splits: list[int]  # how many come from each rank


def _halo_plan(layout: SequenceLayout, rank: int) -> _HaloPlan:
    sends, recvs = [], []
    for slot, chunk in enumerate(layout.chunks(rank)):
        if chunk + 1 < layout.num_chunks:
            dst, dst_slot = layout.owner(chunk + 1)
            sends.append((dst, dst_slot, slot))
        if chunk > 0:
            src, _ = layout.owner(chunk - 1)
            recvs.append((src, slot))
    sends.sort()
    recvs.sort()
    return _HaloPlan(
        [slot for _, _, slot in sends], [sum(1 for d, _, _ in sends if d == r) for r in range(layout.ranks)],
        [slot for _, slot in recvs], [sum(1 for s, _ in recvs if s == r) for r in range(layout.ranks)],
    )


class _HaloExchange(torch.autograd.Function):
    """Forward: every tail goes to the rank holding the chunk after it. Backward: the gradients go back the
    same way, reversed. One `all_to_all_single` each way."""

    @staticmethod
    def forward(ctx, tails: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        return cp.pass_tails(tails, "cp_halo")

    @staticmethod
    def backward(ctx, grad_pasts: Tensor):
        return ctx.cp.pass_tails(grad_pasts, "cp_halo", reverse=True), None


def _route(values: Tensor, cp: ContextParallel, from_slots: list[int], from_splits: list[int], to_slots: list[int],
           to_splits: list[int], kind: str) -> Tensor:
    """values [B, S, n]: the rows of `from_slots` (grouped by destination rank, `from_splits` per rank) land in
    the rows `to_slots` of the result (grouped by source rank, `to_splits` per rank); the other rows are 0."""
    B, S, n = values.shape
    send = values[:, from_slots].transpose(0, 1).reshape(-1)
    recv = values.new_empty(len(to_slots) * B * n)
    all_to_all_single(recv, send, [k * B * n for k in to_splits], [k * B * n for k in from_splits], cp.group,
                      cp.counter, kind)
    out = values.new_zeros(B, S, n)
    if to_slots:
        out[:, to_slots] = recv.view(-1, B, n).transpose(0, 1)
    return out
