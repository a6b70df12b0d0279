"""Attention over a sequence split by `zaya.parallel.context`, packed documents or not: two kernels behind one
interface.

Each rank holds queries, keys and values for its chunks. The kernels visit the key/value blocks of every rank
and, for each pair (query chunk cq, key chunk ck <= cq), run the segments of the mask for that pair
(`zaya.model.masks.DocumentLayout.segments` of the two chunks' ranges, in global indices) through
`zaya.model.segment_attention`. Without packed documents every row is one document, and the segments are the
causal mask's blocks: a causal square when ck = cq, a full rectangle when ck < cq. With packed documents only
the documents a pair shares are computed: a key chunk that holds nothing of the documents of a query chunk
costs nothing, and neither does one beyond the sliding window. (A window that reaches no further than the chunk
before runs the halo kernel of `zaya.parallel.cp_window` instead, which moves W - 1 keys a chunk, not every
block; these kernels are its fallback for longer windows.) Every segment gives a partial (output,
log-sum-exp), merged in fp32 (fp64 for fp64 inputs) in the stable form

    lse = logaddexp(lse_a, lse_b),   o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).

- "allgather": all-gather every rank's keys and values, then attend (one collective; works on gloo).
- "ring": pass key/value blocks rank to rank (r sends to r + 1), the next transfer posted before the current
  block is computed, so that it overlaps the compute. A block this rank has no segments with still travels on.

Backward (both kernels) recomputes each segment's probabilities from the saved global log-sum-exp (the flash
backward of `zaya.model.segment_attention`). The all-gather kernel gathers again and returns every block's
dK, dV to its owner with one all-to-all; the ring kernel sends each block's partial dK, dV along with it,
starting at the rank after its owner, so that after cp - 1 hops it arrives home: (cp - 1) blocks of keys
and values in each direction, the minimum.

`ContextParallel.attention_work` counts the query-key pairs computed (`zaya.model.masks.segment_work` of the
segments run in forward).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.model.masks import DocumentLayout, segment_work
from zaya.model.segment_attention import (
    Segments,
    acc_dtype,
    query_groups,
    segments_backward,
    segments_forward,
)
from zaya.parallel.comm import all_to_all_single, ring_shift
from zaya.parallel.cp_window import WindowPlan, window_attention

KERNELS = ("allgather", "ring")


# ---- the plan: which segments of which pair of chunks ----------------------------------------------------

class PairPlan:
    """The segments of this rank's query chunks against the chunks of each source rank, mapped onto local
    tensors: `sources[src]` is a list of (`Segments`, work), one per pair of chunks that has any segment; the
    pairs without one are left out (no compute). Built on the host from the layouts, once per sequence shard."""

    def __init__(self, layout, rank: int, documents: DocumentLayout, first: Tensor, batch: int):
        L = layout.chunk_len
        mine = layout.chunks(rank)
        self.sources: list[list[tuple[Segments, int]]] = []
        for src in range(layout.ranks):
            pairs = []
            for i, cq in enumerate(mine):
                for j, ck in enumerate(layout.chunks(src)):
                    if ck > cq:
                        continue
                    table = documents.segments((cq * L, (cq + 1) * L), (ck * L, (ck + 1) * L))
                    if len(table):
                        # local query index = global - (cq - i) L; local key index in the source's block likewise
                        segments = Segments(table, (cq - i) * L, (ck - j) * L, first, documents.window)
                        pairs.append((segments, segment_work(table, batch)))
            self.sources.append(pairs)

    @property
    def work(self) -> int:
        """The query-key pairs of every segment: what one forward computes."""
        return sum(w for pairs in self.sources for _, w in pairs)


# ---- communication --------------------------------------------------------------------------------------

def _all_gather(tensor: Tensor, cp) -> list[Tensor]:
    out = [torch.empty_like(tensor) for _ in range(cp.size)]
    dist.all_gather(out, tensor.contiguous(), group=cp.group)
    if cp.counter is not None:
        cp.counter.all_gather("cp_kv", tensor.numel() * tensor.element_size(), cp.size)
    return out


_TAGS = {"cp_kv": 1, "cp_dkv": 2}  # keys and gradients may be in flight between the same ranks at once


def _ring_send(tensor: Tensor, cp, kind: str) -> tuple[Tensor, list]:
    """Post: send `tensor` to the next rank, receive the previous rank's into a new buffer."""
    incoming = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return incoming, ring_shift(tensor, incoming, cp.group, cp.counter, kind, _TAGS[kind])


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


# ---- the kernels ----------------------------------------------------------------------------------------

def attention_forward(q: Tensor, k: Tensor, v: Tensor, cp, plan: PairPlan) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, T, d] in q's dtype, lse [B, Hk, g, T] in the accumulation dtype)."""
    B, Hq, T, d = q.shape
    scale = 1.0 / math.sqrt(d)
    q5 = query_groups(q, k.shape[1])
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q5.shape, dtype=acc, device=q.device)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)

    def attend(src: int, kv: Tensor) -> None:
        for segments, work in plan.sources[src]:
            segments_forward(q5, kv[0], kv[1], segments, scale, out, lse)
            cp.count_work(work)

    kv = torch.stack([k, v])
    if cp.kernel == "allgather":
        for src, block in enumerate(_all_gather(kv, cp)):
            attend(src, block)
    else:
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            if step < cp.size - 1:
                incoming, requests = _ring_send(kv, cp, "cp_kv")  # in flight while this block computes
            attend(src, kv)
            if step < cp.size - 1:
                _wait(requests)
                kv = incoming
    return out.view(B, Hq, T, d).to(q.dtype), lse


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cp,
                       plan: PairPlan):
    """dq, dk, dv (in the inputs' dtypes) from the saved output and global log-sum-exp."""
    B, Hq, T, d = q.shape
    Hk = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    acc = lse.dtype
    q5, do5, out5 = query_groups(q, Hk), query_groups(dout, Hk), query_groups(out, Hk)
    delta = (do5.to(acc) * out5.to(acc)).sum(-1)
    dq5 = torch.zeros(q5.shape, dtype=acc, device=q.device)

    def grad(src: int, kv: Tensor, dkv: Tensor) -> None:
        """Add the gradients of the segments of source `src`'s block kv [2, B, Hk, T, d] to dq5 and dkv."""
        for segments, _ in plan.sources[src]:
            segments_backward(q5, kv[0], kv[1], segments, scale, do5, out5, lse, delta, dq5, dkv[0], dkv[1])

    kv = torch.stack([k, v])
    if cp.kernel == "allgather":
        blocks = _all_gather(kv, cp)
        grads = torch.zeros((cp.size, *kv.shape), dtype=acc, device=q.device)
        for src, block in enumerate(blocks):
            grad(src, block, grads[src])
        # every block's gradient to its owner: rank r receives cp partial sums of its own dk, dv
        received = torch.empty_like(grads)
        n = kv.numel()
        all_to_all_single(received.view(-1), grads.view(-1), [n] * cp.size, [n] * cp.size, cp.group,
                          cp.counter, "cp_dkv")
        dkv = received.sum(0)
    else:
        own = torch.zeros(kv.shape, dtype=acc, device=q.device)
        pending = _ring_send(kv, cp, "cp_kv") if cp.size > 1 else None  # overlaps my own blocks' gradients
        grad(cp.rank, kv, own)
        travelling = None  # a block's partial gradient on its way to the next rank: (buffer, requests)
        for step in range(1, cp.size):
            incoming, requests = pending
            _wait(requests)
            kv = incoming
            if step < cp.size - 1:
                pending = _ring_send(kv, cp, "cp_kv")
            partial = torch.zeros(kv.shape, dtype=acc, device=q.device)
            grad((cp.rank - step) % cp.size, kv, partial)
            if travelling is not None:  # the same block's partial gradient from the ranks before
                buffer, waiting = travelling
                _wait(waiting)
                partial += buffer
            travelling = _ring_send(partial, cp, "cp_dkv")
        dkv = own
        if travelling is not None:  # home after cp - 1 hops: every other rank's part of my blocks' gradient
            buffer, waiting = travelling
            _wait(waiting)
            dkv = own + buffer
    dq = dq5.view(B, Hq, T, d).to(q.dtype)
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp, plan: PairPlan) -> Tensor:
        out, lse = attention_forward(q, k, v, cp, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.plan = cp, plan
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return (*attention_backward(dout, q, k, v, out, lse, ctx.cp, ctx.plan), None, None)


@torch.compiler.disable
def context_attention(q: Tensor, k: Tensor, v: Tensor, cp, window: int | None = None) -> Tensor:
    """Attention of this rank's q [B, Hq, T, d] over the whole sequence (k, v [B, Hk, T, d] here), causal,
    within each packed document and within a sliding `window`, differentiable; `cp` is the `ContextParallel`
    of the sequence. Its plan for these rows (`ContextParallel.attention_plan`) picks the kernel: the halo
    kernel (`zaya.parallel.cp_window`) for a window that reaches no further than the chunk before, else the
    all-gather or ring kernel. Eager, plan and all: a compiled block calls it as it is."""
    plan = cp.attention_plan(q.shape[0], q.device, window)
    if isinstance(plan, WindowPlan):
        return window_attention(q, k, v, cp, plan)
    return _ContextAttention.apply(q, k, v, cp, plan)
