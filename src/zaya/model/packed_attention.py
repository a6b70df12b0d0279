"""Attention over packed documents on one device, as one operator: `packed_attention(q, k, v, segments, first)`.

The segments (`zaya.model.masks`) are a host tensor, planned from the tokens before they reached the device, so
running them reads nothing back from it; the operator is a custom op of torch's operator registry, so a compiled block
keeps it inside its one graph (its shape is q's, whatever the documents) and calls it as it is. Forward runs
every segment's fused kernel and keeps the global log-sum-exp; backward runs each segment's backward from it
(`zaya.model.segment_attention`). Memory beyond the kernels' own: the output, the log-sum-exp and, per MASKED
segment, its mask of at most a pack's or a window tile's size. `attend` and `attend_backward` are the operator's
two halves as plain functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch import library as registry

from zaya.device import autocast_dtype
from zaya.model.segment_attention import Segments, acc_dtype, query_groups, segments_backward, segments_forward


def attend(q: Tensor, k: Tensor, v: Tensor, segments: Tensor, first: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """The operator's forward, as a plain function: output [B, Hq, T, d] in q's dtype and log-sum-exp
    [B, Hq, T] in the accumulation dtype (`window` 0: none)."""
    B, Hq, T, d = q.shape
    q5 = query_groups(q.contiguous(), k.shape[1])
    acc = acc_dtype(q.dtype)
    plan = Segments(segments, 0, 0, first, window if window > 0 else None)
    # each query in one segment: its output is written once, in q's dtype (bf16 needs no fp32 copy of it all)
    out = torch.zeros(q5.shape, dtype=q.dtype if plan.disjoint else acc, device=q.device)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    segments_forward(q5, k.contiguous(), v.contiguous(), plan, 1.0 / math.sqrt(d), out, lse, fresh=True)
    return out.view(B, Hq, T, d).to(q.dtype), lse.view(B, Hq, T)


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, segments: Tensor,
                    first: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The operator's backward, as a plain function: dq, dk, dv in the inputs' dtypes."""
    Hk, d = k.shape[1], q.shape[-1]
    q5, do5, out5 = (query_groups(x.contiguous(), Hk) for x in (q, dout, out))
    lse5 = lse.view(q5.shape[:-1])
    acc = lse.dtype
    plan = Segments(segments, 0, 0, first, window if window > 0 else None)
    # gradients written once (each query, each key in one segment) are kept in the inputs' dtype; delta is
    # formed per segment, by those that need it (the fused kernel forms its own)
    dq = torch.zeros(q5.shape, dtype=q.dtype if plan.disjoint else acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype if plan.keys_disjoint else acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype if plan.keys_disjoint else acc, device=v.device)
    segments_backward(q5, k.contiguous(), v.contiguous(), plan, 1.0 / math.sqrt(d), do5, out5, lse5, None,
                      dq, dk, dv)
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_forward = registry.custom_op("zaya::packed_attention", attend, mutates_args=())


# The fake outputs have the real ones' strides, contiguous, whatever the inputs' (q and k come in transposed): a
# compiled graph plans its views on the fake's strides.
@_forward.register_fake
def _(q, k, v, segments, first, window):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


_backward = registry.custom_op("zaya::packed_attention_backward", attend_backward, mutates_args=())


@_backward.register_fake
def _(dout, q, k, v, out, lse, segments, first, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


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
    `first` [B, T] (on q's device: where each token's document starts; [B, 0]: one document per row) and the
    sliding `window`."""
    if segments.device.type != "cpu":  # the operator reads the plan: from a device, every call would wait for it
        raise ValueError(f"the attention's segments are on {segments.device}: they are a host tensor, planned "
                         "and read there")
    q, k, v = in_autocast_dtype(q, k, v)
    return _forward(q, k, v, segments, first, 0 if window is None else int(window))[0]


def in_autocast_dtype(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in autocast's dtype where autocast is on (else as they are): what SDPA computes in and saves
    under autocast, which a custom kernel's inputs do not get by themselves (their elementwise math runs in the
    fp32 of the master weights)."""
    dtype = autocast_dtype(tensors[0].device)
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)
