"""Decoding with a fixed-capacity cache and a one-token step that `torch.compile` turns into one graph.

Eager decoding of a small model is bound by per-operator overhead, not by its math: `tiny` issues about 250
kernels per token, each a few microseconds of dispatch, against ~0.4 ms of weight streaming. The step below
is the eager decode path (the same module methods, so the same numerics) rewritten without what stops a
compiler from fusing it whole:

- the caches are preallocated to a fixed capacity S; a new key/value is written at its position with
  `index_copy_`, and attention runs over all S slots with the slots after the position masked out;
- the position is a tensor, so one compiled graph serves every step;
- each token's expert weights are gathered by index (`Experts.gathered`), so no host sync picks the expert.

The prompt is prefilled by the eager model into its growing cache, which is then copied into the static one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

from zaya.errors import ZayaError
from zaya.model.attention import DecodeCache
from zaya.model.transformer import Zaya

CAPACITY_QUANTUM = 256  # capacities are rounded up to a multiple of this, so nearby lengths share a graph


@dataclass
class StaticCache:
    """Per attention layer: post-RoPE keys and values [B, n_k, S, d] (slots past the position hold
    anything, they are masked), the convolutions' state [B, P, C] and the value-shift state [B, 1, n_k d / 2]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    conv: list[torch.Tensor]
    shift: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def from_cache(cls, cache: DecodeCache, capacity: int) -> StaticCache:
        """A copy of an eager cache, in buffers of `capacity` positions."""
        if cache.length > capacity:
            raise ZayaError(f"the decode cache holds {cache.length} positions, more than the capacity {capacity}")
        keys, values = [], []
        for layer in cache.layers:
            B, H, _, d = layer.keys.shape
            k = layer.keys.new_zeros(B, H, capacity, d)
            v = layer.values.new_zeros(B, H, capacity, d)
            k[:, :, : layer.length] = layer.keys[:, :, : layer.length]
            v[:, :, : layer.length] = layer.values[:, :, : layer.length]
            keys.append(k)
            values.append(v)
        conv = [layer.conv_state.clone() for layer in cache.layers]
        shift = [layer.value_state.clone() for layer in cache.layers]
        return cls(keys, values, conv, shift)


def round_capacity(length: int) -> int:
    """The capacity a static cache gets for `length` positions."""
    return -(-length // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def decode_step(
    model: Zaya,
    token_B: torch.Tensor,
    position: torch.Tensor,
    cache: StaticCache,
    weights: Sequence[tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """Logits [B, V] of the token after `token_B` [B], which sits at `position` (a 0-d int64 tensor, the
    same for every row); writes its keys, values and states into `cache`. `weights` holds each block's
    `attn.derived_weights()` (else they are derived here, every step)."""
    index = position.reshape(1)
    rope = (*model.rotary(index), model.rotary.partner)
    visible = (torch.arange(cache.capacity, device=index.device) <= index)[None, :]  # [1, S]
    h = model.embed_scaling(model.embed(token_B[:, None]))
    router_state = None
    for i, block in enumerate(model.blocks):
        attn = block.attn
        derived = weights[i] if weights is not None else None
        q, k, v, conv, shift = attn.project(block.attn_norm(h), rope, cache.conv[i], cache.shift[i], derived)
        cache.conv[i].copy_(conv)
        cache.shift[i].copy_(shift)
        cache.keys[i].index_copy_(2, index, k.to(cache.keys[i].dtype))
        cache.values[i].index_copy_(2, index, v.to(cache.values[i].dtype))
        keys, values = cache.keys[i].to(q.dtype), cache.values[i].to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
        a = attn.o_proj(out.transpose(1, 2).flatten(2))
        h, router_state = block.after_attention(a, h, router_state, gathered=True)
    return model.logits(model.norm(h)[:, -1])


class _Step(torch.nn.Module):
    # A module, so that `torch.compile` sees the model's weights as parameters of what it compiles (inputs
    # of the graph, not constants: a decoder keeps serving a model whose weights change in place).
    def __init__(self, model: Zaya):
        super().__init__()
        self.model = model

    def forward(self, token_B, position, keys, values, conv, shift, weights):
        return decode_step(self.model, token_B, position, StaticCache(keys, values, conv, shift), weights)


class CompiledDecoder:
    """`decode_step` of one model, compiled: one graph per batch size, capacity and weight dtype.

    The first step of each such shape compiles (10-20 s on a CPU: inductor writes and builds C++); later
    steps run the graph through inductor's C++ wrapper, which costs far less per kernel than its Python one.
    """

    def __init__(self, model: Zaya):
        self.model = model
        self._step = torch.compile(_Step(model), dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
        self._derived: tuple[weakref.ref, list] | None = None  # (the cache they were made for, weights)

    def __call__(self, token_B: torch.Tensor, position: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """The logits [B, V] of `decode_step`."""
        if self._derived is None or self._derived[0]() is not cache:
            # a new generation: derive the attention weights once for all its steps; a compiled step would
            # otherwise rebuild them every time (the memo that spares the eager path cannot be traced)
            self._derived = (weakref.ref(cache), [block.attn.derived_weights() for block in self.model.blocks])
        try:
            return self._step(token_B, position, cache.keys, cache.values, cache.conv, cache.shift, self._derived[1])
        except BackendCompilerFailed as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ZayaError(f"compiling the decode step failed (it needs a working C++ compiler): {first}") from None
