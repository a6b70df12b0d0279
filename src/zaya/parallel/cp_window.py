"""Sliding-window attention over a sequence split by `zaya.parallel.context`: the halo kernel.

A sliding block's query t sees the keys t - W < s <= t. The queries of chunk c (tokens [cL, cL + L)) therefore
reach its own keys and the W - 1 before it, [cL - W + 1, cL): where W - 1 <= L, the last W - 1 keys and values
of chunk c - 1 and nothing else, all on the one rank that holds that chunk. Each rank sends every chunk's tail of
keys and values to the holder of the next chunk, as the convolutions' halo goes
(`ContextParallel.pass_tails`: one all-to-all, the first chunk receiving zeros), and computes each chunk's
queries over [halo | its own keys]:

    own    the chunk against itself under the window (`DocumentLayout.segments` of the chunk: bands of tiles)
    halo   the chunk against the W - 1 keys before it (`DocumentLayout.segments` with that key range); none
           for chunk 0, whose halo of zeros is never read

With packed documents kept apart the same segments follow the documents as well: a halo key before a query's
document start lies in no segment. The partial (output, log-sum-exp) of the two are merged as in
`zaya.parallel.cp_attention`, and backward is the same flash backward, whose halo key and value gradients go
back to their owner through the reverse exchange and are added to the tails they came from.

Per layer a rank sends B (W - 1) Hk d keys and values per chunk whose successor is on another rank, in forward,
and their gradients (in the accumulation dtype) in backward: against (cp - 1) T/cp of each for the all-gather
and ring kernels. The halo is kept for backward (at most the rank's own keys and values, W - 1 <= L) rather
than exchanged again. Where W - 1 > L the window spans more than one chunk, and `ContextParallel` runs the
all-gather or ring kernel with a window-aware plan instead (pairs of chunks beyond the window cost nothing
there, but every block still travels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zaya.model.masks import DocumentLayout, segment_work
from zaya.model.segment_attention import Segments, acc_dtype, query_groups, segments_backward, segments_forward


def halo_fits(window: int, chunk_len: int) -> bool:
    """Whether the W - 1 keys a chunk's queries reach before it all lie in the one chunk before it."""
    return window - 1 <= chunk_len


class WindowPlan:
    """The segments of this rank's chunks under a sliding window, mapped onto local tensors: `own` against the
    rank's keys k [B, Hk, T, d], `halo` against the halo [B, Hk, segments (W - 1), d] (slot i's keys at
    [i (W - 1), (i + 1) (W - 1))), each a list of (`Segments`, work). Built on the host, once per split.

    `documents` carries the window; `first` [B or 1, T] is where each local query's document starts, in global
    indices (rows of zeros without packed documents)."""

    def __init__(self, layout, rank: int, documents: DocumentLayout, first: Tensor, batch: int):
        W, L = documents.window, layout.chunk_len
        if W is None or not halo_fits(W, L):
            raise ValueError(f"a halo of window {W} does not fit in chunks of {L} tokens")
        self.halo_len = W - 1
        self.own: list[tuple[Segments, int]] = []
        self.halo: list[tuple[Segments, int]] = []
        for i, c in enumerate(layout.chunks(rank)):
            start = c * L
            offset = (c - i) * L  # local query (and own key) index = global - offset
            table = documents.segments((start, start + L))
            self.own.append((Segments(table, offset, offset, first, W), segment_work(table, batch)))
            if c > 0 and self.halo_len:
                table = documents.segments((start, start + L), (start - self.halo_len, start))
                if len(table):  # halo key j of slot i sits at i (W - 1) + j, global start - (W - 1) + j
                    segments = Segments(table, offset, start - self.halo_len - i * self.halo_len, first, W)
                    self.halo.append((segments, segment_work(table, batch)))

    @property
    def work(self) -> int:
        """The query-key pairs of every segment: what one forward computes."""
        return sum(w for pairs in (self.own, self.halo) for _, w in pairs)


# ---- the halo of keys and values ---------------------------------------------------------------------------

def _tails(kv: Tensor, segments: int, n: int) -> Tensor:
    """kv [2, B, Hk, T, d] -> [B, segments, 2 Hk n d]: the last n keys and values of each segment."""
    _, B, Hk, T, d = kv.shape
    L = T // segments
    return kv.view(2, B, Hk, segments, L, d)[:, :, :, :, L - n:].permute(1, 3, 0, 2, 4, 5).reshape(B, segments, -1)


def _as_keys(flat: Tensor, Hk: int, n: int, d: int) -> Tensor:
    """[B, segments, 2 Hk n d] -> [2, B, Hk, segments n, d]: each segment's halo, side by side."""
    B, S, _ = flat.shape
    return flat.view(B, S, 2, Hk, n, d).permute(2, 0, 3, 1, 4, 5).reshape(2, B, Hk, S * n, d)


def _exchange(kv: Tensor, cp, n: int) -> Tensor:
    """The halo [2, B, Hk, segments n, d]: the last n keys and values of the chunk before each of mine."""
    Hk, d = kv.shape[2], kv.shape[-1]
    return _as_keys(cp.pass_tails(_tails(kv, cp.segments, n), "cp_window_kv"), Hk, n, d)


def _return_halo_grads(dhalo: Tensor, cp, n: int, dkv: Tensor) -> None:
    """Send the halo's gradients [2, B, Hk, segments n, d] back to the chunks they came from, added in place
    to the tails of dkv [2, B, Hk, T, d]."""
    _, B, Hk, _, d = dhalo.shape
    S = cp.segments
    flat = dhalo.view(2, B, Hk, S, n, d).permute(1, 3, 0, 2, 4, 5).reshape(B, S, -1)
    back = cp.pass_tails(flat, "cp_window_dkv", reverse=True)
    L = dkv.shape[3] // S
    dkv.view(2, B, Hk, S, L, d)[:, :, :, :, L - n:] += back.view(B, S, 2, Hk, n, d).permute(2, 0, 3, 1, 4, 5)


# ---- the kernel -----------------------------------------------------------------------------------------------

class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp, plan: WindowPlan) -> Tensor:
        B, Hq, T, d = q.shape
        kv = torch.stack([k, v])
        n = plan.halo_len
        halo = _exchange(kv, cp, n) if n else kv[:, :, :, :0]
        q5 = query_groups(q, k.shape[1])
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q5.shape, dtype=acc, device=q.device)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        scale = 1.0 / math.sqrt(d)
        for keys, pairs in ((kv, plan.own), (halo, plan.halo)):
            for segments, work in pairs:
                segments_forward(q5, keys[0], keys[1], segments, scale, out, lse)
                cp.count_work(work)
        out = out.view(B, Hq, T, d).to(q.dtype)
        ctx.save_for_backward(q, kv, halo, out, lse)
        ctx.cp, ctx.plan = cp, plan
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kv, halo, out, lse = ctx.saved_tensors
        cp, plan = ctx.cp, ctx.plan
        Hk, d = kv.shape[2], q.shape[-1]
        acc = lse.dtype
        q5, do5, out5 = query_groups(q, Hk), query_groups(dout.contiguous(), Hk), query_groups(out, Hk)
        delta = (do5.to(acc) * out5.to(acc)).sum(-1)
        dq5 = torch.zeros(q5.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dhalo = torch.zeros(halo.shape, dtype=acc, device=q.device)
        scale = 1.0 / math.sqrt(d)
        for keys, grads, pairs in ((kv, dkv, plan.own), (halo, dhalo, plan.halo)):
            for segments, _ in pairs:
                segments_backward(q5, keys[0], keys[1], segments, scale, do5, out5, lse, delta, dq5, grads[0],
                                  grads[1])
        if plan.halo_len:
            _return_halo_grads(dhalo, cp, plan.halo_len, dkv)
        dq = dq5.view(q.shape).to(q.dtype)
        return dq, dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None


def window_attention(q: Tensor, k: Tensor, v: Tensor, cp, plan: WindowPlan) -> Tensor:
    """Attention of this rank's q [B, Hq, T, d] within a sliding window over the split sequence (k, v
    [B, Hk, T, d] here), causal and within each packed document, differentiable; `plan` is this split's
    `WindowPlan` for the window (`zaya.parallel.cp_attention.context_attention` calls it, eagerly)."""
    return _WindowAttention.apply(q, k, v, cp, plan)
