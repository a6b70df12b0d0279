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
left padding of an unsharded sequence. Nothing resets at document boundaries, so a packed sequence behaves
exactly as it does on one device. The attention kernels are in `zaya.parallel.cp_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.errors import ZayaError
from zaya.parallel.comm import CommCounter, all_to_all_single
from zaya.parallel.config import sequence_split_problem


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence of `length` tokens is split over `ranks` ranks (see the module docstring)."""

    length: int
    ranks: int
    sharding: str = "headtail"

    @property
    def num_chunks(self) -> int:
        return 2 * self.ranks if self.sharding == "headtail" else self.ranks

    @property
    def chunk_len(self) -> int:
        return self.length // self.num_chunks

    def check(self, min_chunk: int = 1) -> str | None:
        """What is wrong with this layout (None if nothing): `zaya.parallel.config.sequence_split_problem`."""
        return sequence_split_problem(self.length, self.ranks, self.sharding, min_chunk)

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks rank `rank` holds, in the order its tokens are laid out."""
        if self.sharding == "headtail":
            return (rank, 2 * self.ranks - 1 - rank)
        return (rank,)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot): who holds `chunk`, and where among its chunks."""
        if self.sharding == "contiguous":
            return chunk, 0
        return (chunk, 0) if chunk < self.ranks else (2 * self.ranks - 1 - chunk, 1)

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
    `attention_work` counts the query-key pairs the kernels computed (the causal mask's work)."""

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
        self._halo_plan = _halo_plan(layout, self.rank)
        # collectives inside: a compiled block calls it eagerly. Wrapped here rather than decorated, since
        # `torch.compiler.disable` imports the compiler (most of a second) and a run without cp needs none.
        self.exchange_halo = torch.compiler.disable(self._exchange_halo)

    @property
    def segments(self) -> int:
        """Contiguous runs of the global sequence among this rank's tokens."""
        return len(self.chunk_ids)

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        return self.layout.positions(self.rank, device)

    def shard(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-sequence tensor (token ids, targets)."""
        return self.layout.shard(tensor, self.rank, dim)

    def _exchange_halo(self, tails: Tensor) -> Tensor:
        """`tails` [B, segments, n]: what each of this rank's segments ends with. Returns [B, segments, n]:
        what the segment logically preceding each of them ends with (zeros before the first chunk)."""
        return _HaloExchange.apply(tails, self)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of this rank's queries [B, Hq, T, d] over the whole sequence's keys and values,
        of which this rank holds k, v [B, Hk, T, d]."""
        from zaya.parallel.cp_attention import context_attention

        return context_attention(q, k, v, self)


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
        plan = cp._halo_plan
        return _route(tails, cp, plan.send_slots, plan.send_splits, plan.recv_slots, plan.recv_splits)

    @staticmethod
    def backward(ctx, grad_pasts: Tensor):
        cp = ctx.cp
        plan = cp._halo_plan
        return _route(grad_pasts, cp, plan.recv_slots, plan.recv_splits, plan.send_slots, plan.send_splits), None


def _route(values: Tensor, cp: ContextParallel, from_slots: list[int], from_splits: list[int], to_slots: list[int],
           to_splits: list[int]) -> Tensor:
    """values [B, S, n]: the rows of `from_slots` (grouped by destination rank, `from_splits` per rank) land in
    the rows `to_slots` of the result (grouped by source rank, `to_splits` per rank); the other rows are 0."""
    B, S, n = values.shape
    send = values[:, from_slots].transpose(0, 1).reshape(-1)
    recv = values.new_empty(len(to_slots) * B * n)
    all_to_all_single(recv, send, [k * B * n for k in to_splits], [k * B * n for k in from_splits], cp.group,
                      cp.counter, "cp_halo")
    out = values.new_zeros(B, S, n)
    if to_slots:
        out[:, to_slots] = recv.view(-1, B, n).transpose(0, 1)
    return out
