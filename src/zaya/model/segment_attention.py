"""Softmax attention over the segments of a mask (`zaya.model.masks`): one fused kernel call per segment, each
giving a partial (output, log-sum-exp) that is merged in fp32 (fp64 for fp64 inputs) in the stable form

    lse = logaddexp(lse_a, lse_b),   o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).

Backward recomputes each segment's probabilities from the saved global log-sum-exp, P = exp(S - lse), and with
delta = rowsum(dO * O) forms dV = P^T dO, dS = P (dO V^T - delta), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d):
a segment's gradient needs nothing from the other segments but lse and delta, so one device's segments and
those of a context-parallel rank's chunk pairs (`zaya.parallel.cp_attention`) run the same code.

Grouped-query attention is done in place: the g query heads of a KV head are a batch dimension of its scores
(a stride-0 expansion of the keys and values in a fused kernel's call), so keys and values are never repeated.
Where the device has no fused kernel that returns its log-sum-exp (`zaya.device.fused_block_attention`), the
scores are formed explicitly, a tile of queries at a time, so that no [T, T] tensor is formed for a long
document either.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from zaya.device import fused_block_attention
from zaya.model.masks import CAUSAL, MASKED, allowed

# The fused CPU kernel, fed few queries against many more keys (a context-parallel block of a document's last
# queries, a decode step), is slower than explicit scores at head dimension 128 (32 x 1024: 7.5 ms against
# 4.5 ms, forward and backward of 8 heads); square blocks it runs 2-3x faster at any size.
_FUSED_MIN_QUERIES = 32
_EXPLICIT_SCORES = 1 << 22  # scores per head the explicit path forms at once (16 MiB in fp32)
# A segment with more query elements than this runs one (row, KV head) at a time: a kernel's outputs are fresh
# tensors of the segment's size (g-fold for the key gradients of grouped queries) that exist beside the
# accumulators, and a long document's would be most of a layer's attention memory again.
_SPLIT_ELEMENTS = 1 << 21


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs and log-sum-exps are kept and merged in."""
    return torch.promote_types(dtype, torch.float32)


def query_groups(x: Tensor, num_kv: int) -> Tensor:
    """[B, Hq, T, d] -> [B, Hk, g, T, d]: the query heads of each KV head side by side (a view where it can be)."""
    B, Hq, T, d = x.shape
    return x.reshape(B, num_kv, Hq // num_kv, T, d)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- one block ------------------------------------------------------------------------------------------

def _scores(q5: Tensor, k: Tensor, causal: bool, scale: float, mask: Tensor | None) -> Tensor:
    """Scores [B, Hk, g, Lq, Lk] of q5 [B, Hk, g, Lq, d] against k [B, Hk, Lk, d]: -inf above the diagonal
    when `causal` (queries and keys end together), and where `mask` [Lq, Lk] is False. The [Lq, Lk] tensors of
    the explicit path are changed in place: each is a memory pass, and they are the path's cost."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q5, k).to(acc_dtype(q5.dtype)).mul_(scale)
    Lq, Lk = s.shape[-2:]
    if causal:
        s.masked_fill_(torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).triu(Lk - Lq + 1), float("-inf"))
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def _fused_operands(q5: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The layout of the fused kernels, grouped-query attention without copies: each (row, KV head) is a batch
    entry, its g query heads the heads, and its keys and values a stride-0 expansion to them: q [B Hk, g, Lq, d],
    k and v [B Hk, g, Lk, d]."""
    B, Hk, g, Lq, d = q5.shape
    Lk = k.shape[2]
    return (q5.reshape(B * Hk, g, Lq, d), k.reshape(B * Hk, 1, Lk, d).expand(-1, g, -1, -1),
            v.reshape(B * Hk, 1, Lk, d).expand(-1, g, -1, -1))


# The additive form of each mask, by the mask's identity, for as long as the mask lives: a sliding band's masks
# (one per tile shape, `zaya.model.masks.band_mask`) live on, so theirs are made once per dtype.
_ADDITIVE: dict[int, tuple[weakref.ref, dict[torch.dtype, Tensor]]] = {}


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None:
        return None
    key = id(mask)
    entry = _ADDITIVE.get(key)
    if entry is None or entry[0]() is not mask:
        entry = _ADDITIVE[key] = (weakref.ref(mask, lambda _, key=key: _ADDITIVE.pop(key, None)), {})
    made = entry[1]
    if dtype not in made:
        made[dtype] = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                                  torch.full((), float("-inf"), dtype=dtype, device=mask.device))
    return made[dtype]


def _use_fused(q5: Tensor, k: Tensor, causal: bool):
    """The fused (forward, backward) pair, if it may take this block: a square, or enough queries; a causal block
    only as a square (the kernels align their causal mask at the top left)."""
    fused = fused_block_attention(q5.device)
    Lq, Lk = q5.shape[3], k.shape[2]
    if fused is None or Lk == 0 or (Lq < _FUSED_MIN_QUERIES and Lq != Lk):
        return None
    if causal and Lq != Lk:
        return None
    return fused


def _tiles(q5: Tensor, k: Tensor, causal: bool, mask: Tensor | None):
    """(query slice, key slice, causal, mask) tiles of queries for the explicit path, each forming at most
    `_EXPLICIT_SCORES` scores per head (16 queries at least): a causal block's tile sees the keys up to its last
    query."""
    Lq, Lk = q5.shape[3], k.shape[2]
    tile = max(16, _EXPLICIT_SCORES // max(Lk, 1))
    for a in range(0, Lq, tile):
        z = min(a + tile, Lq)
        keys = slice(0, Lk - Lq + z) if causal else slice(0, Lk)
        yield slice(a, z), keys, causal, None if mask is None else mask[a:z, keys]


def block_forward(q5: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One block's softmax attention: output [B, Hk, g, Lq, d] and log-sum-exp [B, Hk, g, Lq], both in the
    accumulation dtype. `causal`: queries and keys end together, key s seen by query t iff s <= t; `mask`
    [Lq, Lk] bool: the pairs allowed. Every query must see at least one key."""
    fused = _use_fused(q5, k, causal)
    acc = acc_dtype(q5.dtype)
    if fused is not None:
        out, lse = fused[0](*_fused_operands(q5, k, v), 0.0, causal, attn_mask=_additive(mask, q5.dtype),
                            scale=scale)
        return out.view(q5.shape).to(acc), lse.view(q5.shape[:-1]).to(acc)
    out = q5.new_empty(q5.shape, dtype=acc)
    lse = q5.new_empty(q5.shape[:-1], dtype=acc)
    for rows, keys, tile_causal, tile_mask in _tiles(q5, k, causal, mask):
        s = _scores(q5[:, :, :, rows], k[:, :, keys], tile_causal, scale, tile_mask)
        tile_lse = torch.logsumexp(s, dim=-1)
        lse[:, :, :, rows] = tile_lse
        p = s.sub_(tile_lse[..., None]).exp_()
        out[:, :, :, rows] = torch.einsum("bhgqk,bhkd->bhgqd", p.to(v.dtype), v[:, :, keys]).to(acc)
    return out, lse


def block_backward(q5: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, do5: Tensor, lse: Tensor,
                   delta: Tensor | None, out5: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq5, dk, dv of one block, from the global `lse` and `delta` = rowsum(dO * O), in the accumulation
    dtype. The fused kernel takes the global output `out5` instead of `delta` (it forms delta itself)."""
    fused = _use_fused(q5, k, causal)
    acc = acc_dtype(q5.dtype)
    if fused is not None:
        B, Hk, g, Lq, _ = q5.shape
        q, kk, vv = _fused_operands(q5, k, v)
        dq, dk, dv = fused[1](do5.reshape(q.shape).to(q.dtype), q, kk, vv, out5.reshape(q.shape).to(q.dtype),
                              lse.reshape(B * Hk, g, Lq).to(_lse_dtype(q.dtype)), 0.0, causal,
                              attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq.view(q5.shape).to(acc), dk.sum(1).reshape(k.shape).to(acc), dv.sum(1).reshape(v.shape).to(acc)
    if delta is None:  # formed here, for this block's queries only, where the caller leaves it to the block
        delta = (do5.to(acc) * out5.to(acc)).sum(-1)
    dq = torch.zeros(q5.shape, dtype=acc, device=q5.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for rows, keys, tile_causal, tile_mask in _tiles(q5, k, causal, mask):
        s = _scores(q5[:, :, :, rows], k[:, :, keys], tile_causal, scale, tile_mask)
        p = s.sub_(lse[:, :, :, rows, None]).exp_()
        do = do5[:, :, :, rows].to(acc)
        dv[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", p, do)
        ds = torch.einsum("bhgqd,bhkd->bhgqk", do, v[:, :, keys].to(acc)).sub_(delta[:, :, :, rows, None]).mul_(p)
        dq[:, :, :, rows] += torch.einsum("bhgqk,bhkd->bhgqd", ds, k[:, :, keys].to(acc)).mul_(scale)
        dk[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", ds, q5[:, :, :, rows].to(acc)).mul_(scale)
    return dq, dk, dv


def merge(acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a partial (out, lse) into an accumulator (None: nothing yet)."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - new)[..., None] + out * torch.exp(lse - new)[..., None], new


# ---- segments -------------------------------------------------------------------------------------------

class Segments:
    """The segments [n, 6] of one query range against one key range (`DocumentLayout.segments`), with what
    maps them onto a device's tensors: `q_offset` and `k_offset`, the global index of the first local query
    and key; `first` [B, Lq], the global index where each local query's document starts (for MASKED segments;
    of no elements: one document per row, whose masks depend on their shape alone and are made once); and the
    sliding `window`. `disjoint`: no query is in two segments (a row's plan against itself), so that
    each query's partial is its whole attention; `keys_disjoint`: no key either (no sliding window's bands), so
    that each key's gradient comes from one segment."""

    def __init__(self, table, q_offset: int, k_offset: int, first: Tensor, window: int | None):
        self.rows = [tuple(int(x) for x in r) for r in (table.tolist() if hasattr(table, "tolist") else table)]
        self.q_offset, self.k_offset, self.first, self.window = q_offset, k_offset, first, window
        spans = sorted((row, q0, q1) for row, q0, q1, *_ in self.rows)
        every_row = any(row < 0 for row, _, _ in spans) and any(row >= 0 for row, _, _ in spans)
        self.disjoint = not every_row and all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(spans))
        self.keys_disjoint = self.disjoint and all((q0, q1) == (k0, k1) for _, q0, q1, k0, k1, _ in self.rows)

    def __iter__(self):
        """(rows, query slice, key slice, causal, mask [Lq, Lk] or None) per segment, in local indices."""
        for row, q0, q1, k0, k1, kind in self.rows:
            rows = slice(None) if row < 0 else slice(row, row + 1)
            mask = None
            if kind == MASKED:
                first = self.first[row, q0 - self.q_offset:q1 - self.q_offset] if self.first.numel() else self.first
                mask = allowed(q0, q1, k0, k1, first, self.window)
            yield (rows, slice(q0 - self.q_offset, q1 - self.q_offset), slice(k0 - self.k_offset, k1 - self.k_offset),
                   kind == CAUSAL, mask)


def _parts(q5: Tensor, rows: slice, qs: slice) -> list[tuple[slice, slice]]:
    """(rows, KV heads) to run one segment of queries `qs` in: all at once, or where it is large
    (`_SPLIT_ELEMENTS`) one row and KV head at a time."""
    B, Hk, g, _, d = q5.shape
    every = rows.start is None
    if (B if every else 1) * Hk * g * (qs.stop - qs.start) * d < _SPLIT_ELEMENTS:
        return [(rows, slice(None))]
    return [(slice(r, r + 1), slice(h, h + 1)) for r in (range(B) if every else [rows.start]) for h in range(Hk)]


def segments_forward(q5: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float,
                     out: Tensor, lse: Tensor, *, fresh: bool = False) -> None:
    """Merge the segments' partial attention of q5 [B, Hk, g, Lq, d] over k, v [B, Hk, Lk, d] into the
    accumulators out [B, Hk, g, Lq, d] and lse [B, Hk, g, Lq] (start: zeros and -inf), in place. `fresh`: the
    accumulators hold nothing yet, so the partials of disjoint segments are written, not merged."""
    write = fresh and segments.disjoint
    for rows, qs, ks, causal, mask in segments:
        for r, h in _parts(q5, rows, qs):
            o, s = block_forward(q5[r, h, :, qs], k[r, h, ks], v[r, h, ks], causal, scale, mask)
            if not write:
                o, s = merge((out[r, h, :, qs], lse[r, h, :, qs]), o, s)
            out[r, h, :, qs], lse[r, h, :, qs] = o, s


def segments_backward(q5: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float, do5: Tensor,
                      out5: Tensor, lse: Tensor, delta: Tensor | None, dq5: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add the segments' gradients to dq5, dk, dv, in place (in the accumulation dtype, or in the inputs' where
    each query, or key, is in one segment only: each is then written once). `delta` None: each segment that
    needs it forms its own part."""
    for rows, qs, ks, causal, mask in segments:
        for r, h in _parts(q5, rows, qs):
            dq, dkk, dvv = block_backward(q5[r, h, :, qs], k[r, h, ks], v[r, h, ks], causal, scale, do5[r, h, :, qs],
                                          lse[r, h, :, qs], None if delta is None else delta[r, h, :, qs],
                                          out5[r, h, :, qs], mask)
            dq5[r, h, :, qs] += dq
            dk[r, h, ks] += dkk
            dv[r, h, ks] += dvv
