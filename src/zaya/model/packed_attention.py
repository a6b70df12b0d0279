"""Attention over packed documents on one device, as one operator: `packed_attention(q, k, v, segments, first)`.

The segments (`zaya.model.masks`) are a host tensor, planned from the tokens before they reached the device, so
running them reads nothing back from it; the operator is a `torch.library` custom op, so a compiled block
keeps it inside its one graph (its shape is q's, whatever the documents) and calls it as it is. Forward runs
every segment's fused kernel and keeps the global log-sum-exp; backward runs each segment's backward from it
(`zaya.model.segment_attention`). Memory beyond the kernels' own: the output, the log-sum-exp and, per MASKED
segment, its mask of at most a pack's or a window tile's size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zaya.model.segment_attention import Segments, acc_dtype, segments_backward, segments_forward


def _split(x: Tensor, num_kv: int) -> Tensor:
    """[B, Hq, T, d] -> [B, Hk, g, T, d]."""
    B, Hq, T, d = x.shape
    return x.view(B, num_kv, Hq // num_kv, T, d)


@torch.library.custom_op("zaya::packed_attention", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, segments: Tensor, first: Tensor, window: int) -> tuple[Tensor, Tensor]:
    B, Hq, T, d = q.shape
    q5 = _split(q.contiguous(), k.shape[1])
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q5.shape, dtype=acc, device=q.device)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    plan = Segments(segments, 0, 0, first, window if window > 0 else None)
    segments_forward(q5, k.contiguous(), v.contiguous(), plan, 1.0 / math.sqrt(d), out, lse)
    return out.view(B, Hq, T, d).to(q.dtype), lse.view(B, Hq, T)


@_forward.register_fake
def _(q, k, v, segments, first, window):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("zaya::packed_attention_backward", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, segments: Tensor,
              first: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    Hk, d = k.shape[1], q.shape[-1]
    q5, do5, out5 = _split(q.contiguous(), Hk), _split(dout.contiguous(), Hk), _split(out.contiguous(), Hk)
    lse5 = lse.view(q5.shape[:-1])
    acc = lse.dtype
    delta = (do5.to(acc) * out5.to(acc)).sum(-1)
    dq = torch.zeros(q5.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    plan = Segments(segments, 0, 0, first, window if window > 0 else None)
    segments_backward(q5, k.contiguous(), v.contiguous(), plan, 1.0 / math.sqrt(d), do5, out5, lse5, delta,
                      dq, dk, dv)
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_backward.register_fake
def _(dout, q, k, v, out, lse, segments, first, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, segments, first, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, segments, first)
    ctx.window = window


def _backward_rule(ctx, dout: Tensor, dlse: Tensor):
    q, k, v, out, lse, segments, first = ctx.saved_tensors
    dq, dk, dv = _backward(dout, q, k, v, out, lse, segments, first, ctx.window)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_backward_rule, setup_context=_setup_context)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, segments: Tensor, first: Tensor,
                     window: int | None = None) -> Tensor:
    """Softmax attention of q [B, Hq, T, d] over k, v [B, Hk, T, d] (Hk divides Hq) restricted to `segments`
    [n, 6] (int64, on the host: `zaya.model.masks.DocumentLayout.segments`), whose MASKED segments read
    `first` [B, T] (on q's device: where each token's document starts) and the sliding `window`."""
    return _forward(q, k, v, segments, first, 0 if window is None else int(window))[0]
