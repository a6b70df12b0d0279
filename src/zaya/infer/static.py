"""Decoding with a fixed-capacity cache and a one-token step that `torch.compile` turns into one graph.

Eager decoding of a small model is bound by per-operator overhead, not by its math: `tiny` issues about 250
kernels per token, each a few microseconds of dispatch, against ~0.4 ms of weight streaming. The step below
is the eager decode path (the same module methods, so the same numerics) rewritten without what stops a
compiler from fusing it whole:

- the caches are preallocated to a fixed capacity S; a new key/value is written at its position with
  `index_copy_`, and attention runs over all S slots with the slots after the position masked out;
- a sliding block's cache is a ring of min(W, S) slots, position p in slot p mod W (the eager ring's rule):
  once the ring is full every slot holds one of the W positions the new token sees, and its memory stays flat
  however long the generation;
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
    anything, they are masked), the convolutions' state [B, P, C] and the value-shift state [B, 1, n_k d / 2].
    A sliding block's S is min(W, capacity): a ring, position p in slot p mod W."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    conv: list[torch.Tensor]
    shift: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        """The most slots of any layer: the positions the full blocks can hold (a sliding block's ring holds
        the last W of any number)."""
        return max(k.shape[2] for k in self.keys)

    @classmethod
    def from_cache(cls, cache: DecodeCache, capacity: int) -> StaticCache:
        """A copy of an eager cache, in buffers of `capacity` positions; a sliding block's ring (the eager
        ring's slots, position p in slot p mod W) in min(W, capacity)."""
        if cache.length > capacity:
            raise ZayaError(f"the decode cache holds {cache.length} positions, more than the capacity {capacity}")
        keys, values = [], []
        for layer in cache.layers:
            B, H, _, d = layer.keys.shape
            slots = capacity if layer.window is None else min(layer.window, capacity)
            # zeros, not garbage, in the slots not yet written: a masked slot's value is still multiplied by 0
            k = layer.keys.new_zeros(B, H, slots, d)
            v = layer.values.new_zeros(B, H, slots, d)
            # the eager ring's slot of position p is p mod W too, and its first `stored` slots are the written ones
            k[:, :, : layer.stored] = layer.keys[:, :, : layer.stored]
            v[:, :, : layer.stored] = layer.values[:, :, : layer.stored]
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
    ropes = model.rope(index)
    # the slots written so far: those up to the position; in a sliding block's ring, all of them once the
    # position reaches W - 1, each then holding one of the W positions the token sees
    visible = {}
    h = model.embed_scaling(model.embed(token_B[:, None]))
    router_state = None
    for i, block in enumerate(model.blocks):
        attn = block.attn
        derived = weights[i] if weights is not None else None
        q, k, v, conv, shift = attn.project(block.attn_norm(h), ropes[block.layer_type], cache.conv[i],
                                            cache.shift[i], derived)
        cache.conv[i].copy_(conv)
        cache.shift[i].copy_(shift)
        slots = cache.keys[i].shape[2]
        slot = index if block.window is None else index % slots  # ring: min(W, capacity) slots
        cache.keys[i].index_copy_(2, slot, k.to(cache.keys[i].dtype))
        cache.values[i].index_copy_(2, slot, v.to(cache.values[i].dtype))
        if slots not in visible:
            visible[slots] = (torch.arange(slots, device=index.device) <= index)[None, :]  # [1, S]
        keys, values = cache.keys[i].to(q.dtype), cache.values[i].to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[slots], enable_gqa=True)
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
