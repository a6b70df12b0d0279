"""Causal attention over a sequence split by `zaya.parallel.context`: two kernels behind one interface.

Each rank holds queries, keys and values for its chunks. The kernels visit the key/value blocks of every
rank and, for each pair (query chunk cq, key chunk ck), compute nothing when ck > cq, a causal block when
ck = cq and a full block when ck < cq; every block gives a partial (output, log-sum-exp) that is merged in
fp32 (fp64 for fp64 inputs) in the stable form

    lse = logaddexp(lse_a, lse_b),   o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).

- "allgather": all-gather every rank's keys and values, then attend (one collective; works on gloo).
- "ring": pass key/value blocks rank to rank (r sends to r + 1), the next transfer posted before the current
  block is computed, so that it overlaps the compute.

Backward (both kernels) recomputes each block's probabilities from the saved global log-sum-exp,
P = exp(S - lse), and with delta = rowsum(dO * O) forms dV = P^T dO, dS = P (dO V^T - delta),
dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d). The all-gather kernel gathers again and returns every block's
dK, dV to its owner with one all-to-all; the ring kernel sends each block's partial dK, dV along with it,
starting at the rank after its owner, so that after cp - 1 hops it arrives home: (cp - 1) blocks of keys
and values in each direction, the minimum.

Grouped-query attention is done in place: the g query heads of a KV head are a batch dimension of its
scores, so keys and values are never repeated.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.device import fused_block_attention
from zaya.parallel.comm import all_to_all_single, ring_shift

KERNELS = ("allgather", "ring")


# ---- one block ------------------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q5: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scores [B, Hk, g, Lq, Lk] of q5 [B, Hk, g, Lq, d] against k [B, Hk, Lk, d]; -inf above the diagonal
    when `causal` (a chunk against itself)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q5, k).to(_acc_dtype(q5.dtype)) * scale
    if causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


# The fused kernels want keys and values repeated to every query head: a copy of the block, worth its cost only
# when enough queries share it (a decode step's one query would copy the whole cache shard for it).
_FUSED_MIN_QUERIES = 32


def _fused_operands(q5: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, Hq, Lq, d] and k, v repeated to Hq heads: the layout of the fused kernels."""
    B, Hk, g, Lq, d = q5.shape
    return q5.reshape(B, Hk * g, Lq, d), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def block_forward(q5: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One block's softmax attention: output [B, Hk, g, Lq, d] and log-sum-exp [B, Hk, g, Lq], both in the
    accumulation dtype. A fused kernel where the device has one (`zaya.device.fused_block_attention`), else
    plain matmuls over the materialised scores."""
    fused = fused_block_attention(q5.device)
    if fused is not None and q5.shape[3] >= _FUSED_MIN_QUERIES and k.shape[2] > 0:
        out, lse = fused[0](*_fused_operands(q5, k, v), 0.0, causal, attn_mask=None, scale=scale)
        acc = _acc_dtype(q5.dtype)
        return out.view(q5.shape).to(acc), lse.view(q5.shape[:-1]).to(acc)
    s = _scores(q5, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhgqk,bhkd->bhgqd", p.to(v.dtype), v).to(s.dtype)
    return out, lse


def block_backward(q5: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, do5: Tensor, lse: Tensor,
                   delta: Tensor, out5: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dq5, dk, dv of one block, from the global `lse` and `delta` = rowsum(dO * O), in the accumulation
    dtype. The fused kernel takes the global output `out5` instead of `delta` (it forms delta itself)."""
    fused = fused_block_attention(q5.device)
    if fused is not None and q5.shape[3] >= _FUSED_MIN_QUERIES:
        B, Hk, g, Lq, d = q5.shape
        q, kk, vv = _fused_operands(q5, k, v)
        acc = _acc_dtype(q5.dtype)
        dq, dk, dv = fused[1](do5.reshape(q.shape).to(q.dtype), q, kk, vv, out5.reshape(q.shape).to(q.dtype),
                              lse.reshape(B, Hk * g, Lq).to(_lse_dtype(q.dtype)), 0.0, causal, attn_mask=None,
                              scale=scale)
        Lk = k.shape[2]
        return (dq.view(q5.shape).to(acc), dk.view(B, Hk, g, Lk, d).sum(2).to(acc),
                dv.view(B, Hk, g, Lk, d).sum(2).to(acc))
    s = _scores(q5, k, causal, scale)
    p = torch.exp(s - lse[..., None])
    acc = s.dtype
    do5 = do5.to(acc)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do5)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do5, v.to(acc)) - delta[..., None])
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q5.to(acc)) * scale
    return dq, dk, dv


def merge(acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a partial (out, lse) into an accumulator (None: nothing yet)."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - new)[..., None] + out * torch.exp(lse - new)[..., None], new


# ---- pairs of chunks ------------------------------------------------------------------------------------

def _pairs(q_chunks, k_chunks):
    """(query slot, key slot, causal) for every pair of chunks the causal mask does not empty."""
    for i, cq in enumerate(q_chunks):
        for j, ck in enumerate(k_chunks):
            if ck <= cq:
                yield i, j, ck == cq


def _split(q: Tensor, num_kv: int, segments: int) -> Tensor:
    """q [B, Hq, S L, d] -> [B, Hk, g, S, L, d]."""
    B, Hq, T, d = q.shape
    return q.view(B, num_kv, Hq // num_kv, segments, T // segments, d)


def _attend(q6: Tensor, kv: Tensor, q_chunks, k_chunks, scale: float, acc: list, cp) -> None:
    """Merge the blocks of one rank's keys and values kv [2, B, Hk, S L, d] into the per-segment
    accumulators `acc`."""
    L = q6.shape[4]
    for i, j, causal in _pairs(q_chunks, k_chunks):
        k, v = kv[0, :, :, j * L:(j + 1) * L], kv[1, :, :, j * L:(j + 1) * L]
        acc[i] = merge(acc[i], *block_forward(q6[:, :, :, i], k, v, causal, scale))
        cp.attention_work += L * (L + 1) // 2 if causal else L * L


def _grad(q6: Tensor, do6: Tensor, out6: Tensor, lse6: Tensor, delta6: Tensor, kv: Tensor, q_chunks, k_chunks,
          scale: float, dq6: Tensor, dkv: Tensor) -> None:
    """Add the gradients of one rank's blocks kv [2, B, Hk, S L, d] to dq6 and dkv."""
    L = q6.shape[4]
    for i, j, causal in _pairs(q_chunks, k_chunks):
        rows = slice(j * L, (j + 1) * L)
        dq, dk, dv = block_backward(q6[:, :, :, i], kv[0, :, :, rows], kv[1, :, :, rows], causal, scale,
                                    do6[:, :, :, i], lse6[:, :, :, i], delta6[:, :, :, i], out6[:, :, :, i])
        dq6[:, :, :, i] += dq
        dkv[0, :, :, rows] += dk
        dkv[1, :, :, rows] += dv


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

def attention_forward(q: Tensor, k: Tensor, v: Tensor, cp) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, T, d] in q's dtype, lse [B, Hk, g, S, L] in the accumulation dtype)."""
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], cp.segments
    scale = 1.0 / math.sqrt(d)
    q6 = _split(q, Hk, S)
    kv = torch.stack([k, v])
    acc: list = [None] * S
    if cp.kernel == "allgather":
        for src, block in enumerate(_all_gather(kv, cp)):
            _attend(q6, block, cp.chunk_ids, cp.layout.chunks(src), scale, acc, cp)
    else:
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            if step < cp.size - 1:
                incoming, requests = _ring_send(kv, cp, "cp_kv")  # in flight while this block computes
            _attend(q6, kv, cp.chunk_ids, cp.layout.chunks(src), scale, acc, cp)
            if step < cp.size - 1:
                _wait(requests)
                kv = incoming
    out = torch.stack([o for o, _ in acc], dim=3).to(q.dtype).view(B, Hq, T, d)
    lse = torch.stack([s for _, s in acc], dim=3)
    return out, lse


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse6: Tensor, cp):
    """dq, dk, dv (in the inputs' dtypes) from the saved output and global log-sum-exp."""
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], cp.segments
    scale = 1.0 / math.sqrt(d)
    acc = lse6.dtype
    q6, do6, out6 = _split(q, Hk, S), _split(dout, Hk, S), _split(out, Hk, S)
    delta6 = (do6.to(acc) * out6.to(acc)).sum(-1)
    dq6 = torch.zeros(q6.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    if cp.kernel == "allgather":
        blocks = _all_gather(kv, cp)
        grads = torch.zeros((cp.size, *kv.shape), dtype=acc, device=q.device)
        for src, block in enumerate(blocks):
            _grad(q6, do6, out6, lse6, delta6, block, cp.chunk_ids, cp.layout.chunks(src), scale, dq6, grads[src])
        # every block's gradient to its owner: rank r receives cp partial sums of its own dk, dv
        received = torch.empty_like(grads)
        n = kv.numel()
        all_to_all_single(received.view(-1), grads.view(-1), [n] * cp.size, [n] * cp.size, cp.group,
                          cp.counter, "cp_dkv")
        dkv = received.sum(0)
    else:
        own = torch.zeros(kv.shape, dtype=acc, device=q.device)
        pending = _ring_send(kv, cp, "cp_kv") if cp.size > 1 else None  # overlaps my own blocks' gradients
        _grad(q6, do6, out6, lse6, delta6, kv, cp.chunk_ids, cp.chunk_ids, scale, dq6, own)
        travelling = None  # a block's partial gradient on its way to the next rank: (buffer, requests)
        for step in range(1, cp.size):
            incoming, requests = pending
            _wait(requests)
            kv = incoming
            if step < cp.size - 1:
                pending = _ring_send(kv, cp, "cp_kv")
            src = (cp.rank - step) % cp.size
            partial = torch.zeros(kv.shape, dtype=acc, device=q.device)
            _grad(q6, do6, out6, lse6, delta6, kv, cp.chunk_ids, cp.layout.chunks(src), scale, dq6, partial)
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
    dq = dq6.view(B, Hq, T, d).to(q.dtype)
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp) -> Tensor:
        out, lse = attention_forward(q, k, v, cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return (*attention_backward(dout, q, k, v, out, lse, ctx.cp), None)


@torch.compiler.disable
def context_attention(q: Tensor, k: Tensor, v: Tensor, cp) -> Tensor:
    """Causal attention of this rank's q [B, Hq, T, d] over the whole sequence (k, v [B, Hk, T, d] here),
    differentiable; `cp` is the `ContextParallel` of the sequence."""
    return _ContextAttention.apply(q, k, v, cp)
