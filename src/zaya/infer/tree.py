"""Decoding with the KV cache split along the sequence over a process group: Tree Attention (spec section 11),
and the ring pass it is measured against.

Layout (contiguous, as `zaya.parallel.context` lays out a sequence): rank r of p holds the r-th chunk of the
prompt's keys and values. Every new token is appended on the LAST rank (the "owner"), which therefore also
holds the two pieces of CCA state that reach back in time: the convolutions' last P packed vectors and the
value shift's last W_vdel x. The other ranks keep keys and values only; their copies of those states, which a
sharded prefill leaves behind describing the ends of their own chunks, are dropped.

One decode step. Every rank runs the embedding, the norms, the MoE sublayers and the residual merges on the
same token, which costs little for one token and keeps every rank's residual stream identical; per attention
layer:

1. the owner projects the token (`CompressedConvAttention.project`, from its conv/value state), appends k, v
   to its cache and broadcasts the query [B, Hq, 1, d];
2. each rank attends with it over its own keys (`block_forward`, no mask: a decode query sees every cached
   key), giving a partial output o_u and log-sum-exp l_u (an empty shard: o_u = 0, l_u = -inf);
3. "tree": M = max_u l_u (one MAX all-reduce), then one SUM all-reduce of [o_u e^(l_u - M) | e^(l_u - M)]
   gives N and D, and the attention output is N / D, exactly the softmax over all keys. The volume is
   independent of the context length and an all-reduce takes O(log p) rounds.
   "ring": each rank's shard travels p - 1 hops around the ring, every rank merging what arrives into its
   partial (out, lse); p - 1 sequential steps moving (p - 1) / p of the whole cache through every rank.
4. o_proj and the rest of the block (`ZayaBlock.after_attention`), replicated.

A sliding block (window W) reads the keys of positions P - W + 1 .. P only, for a token at position P. Its
cache on every rank is a ring of the last W positions of that rank's shard (`AttentionCache(window)`; a sharded
prefill appends rank r's chunk to it as if its positions were 0 .. L - 1, and decoding carries on that count on
the owner): since the ranks hold consecutive runs whose lengths every rank tracks, rank r's shard starts at
the sum of the lengths before it, and the window reaches the last min(its length, start + length - (P - W + 1))
of its positions, a suffix of what its ring holds. A rank the window does not reach reads nothing, and joins
the combination with an empty part; once the window lies within the owner's shard, no other rank is reached
and the owner attends alone and broadcasts the layer's attention output instead of its query.

Bytes sent are counted per rank in a `CommCounter`, as `zaya.parallel.comm` counts them (all-reduce of S bytes:
2 S (p - 1) / p); a broadcast is counted as the pipelined ring broadcast sends it: S bytes from every rank
except the last one of the chain.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.errors import ZayaError
from zaya.infer.generate import Sampling, check_allowed, check_length, check_prompt, decode_loop
from zaya.model.attention import AttentionCache, CompressedConvAttention, DecodeCache
from zaya.model.segment_attention import block_forward, merge
from zaya.model.transformer import Zaya
from zaya.parallel.comm import CommCounter, all_reduce, broadcast, ring_shift
from zaya.parallel.context import ContextParallel, SequenceLayout

KERNELS = ("tree", "ring")


class ShardedDecoder:
    """Decoding state of one sequence batch whose KV cache is split over the ranks of `group` (None: the
    default group). Every rank of the group makes one and calls `prefill` once, then `step` per token, all in
    the same order; both return the same next-token logits [B, V] on every rank.

    `kernel` is "tree" (Tree Attention) or "ring" (the ring-pass baseline); `counter` collects the bytes this
    rank sends, by kind ("query", "tree_max", "tree_sum", "ring_kv", "window_out" (a sliding block's output,
    where the window reaches the owner's shard alone), "prefill", "token", and the sharded prefill's kinds).
    `attended[i]` counts the keys this rank's attention has read in block i over all steps: a shard a sliding
    block's window does not reach adds none.
    """

    def __init__(self, model: Zaya, group: dist.ProcessGroup | None = None, *, kernel: str = "tree",
                 counter: CommCounter | None = None):
        if kernel not in KERNELS:
            raise ZayaError(f"the sharded decode kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if not dist.is_initialized():
            raise ZayaError("sharded decoding needs a process group (dist.init_process_group)")
        self.model = model
        self.group = group if group is not None else dist.group.WORLD
        self.kernel = kernel
        self.counter = counter if counter is not None else CommCounter()
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.owner = self.size - 1
        self.cache = model.new_cache()
        self.position = 0  # tokens seen so far in the whole sequence: the position of the next one
        # tokens in each rank's cache (the same in every layer), tracked on every rank: the ring receives
        # shards of these sizes without asking for them
        self.shard_lengths = [0] * self.size
        self.attended = [0] * len(model.blocks)
        self._device = model.embed.weight.device

    @property
    def is_owner(self) -> bool:
        """Whether this rank holds the newest tokens and the convolution/value-shift states."""
        return self.rank == self.owner

    def sharded_length(self, prompt_len: int) -> int:
        """How many of a prompt's first tokens the sharded prefill takes: the largest multiple of the group
        size, unless that leaves chunks shorter than the P tokens the convolutions reach back across a chunk
        start (then none: the prompt is short, and the decode step takes all of it)."""
        length = prompt_len // self.size * self.size
        if length == 0:
            return 0
        layout = SequenceLayout(length, self.size, "contiguous")
        return length if layout.check(min_chunk=self.model.config.conv_padding) is None else 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: Tensor) -> Tensor:
        """Take the prompt [B, T] (the same on every rank): its first `sharded_length(T)` tokens as one
        context-parallel pass (rank r keeps the r-th chunk's keys and values), the rest token by token.
        Returns the logits [B, V] after its last token."""
        if self.position:
            raise ZayaError("this sharded decoder has already taken its prompt")
        check_prompt(prompt_ids, self.model.config.vocab_size)
        check_length(self.model.config, prompt_ids.shape[1], 0)
        prompt_ids = prompt_ids.to(self._device)
        T = prompt_ids.shape[1]
        sharded = self.sharded_length(T)
        logits = None
        if sharded:
            layout = SequenceLayout(sharded, self.size, "contiguous")
            # the attention kernels are exact; "allgather" is one collective per layer
            cp = ContextParallel(layout, self.group, "allgather", self.counter)
            local = cp.shard(prompt_ids[:, :sharded])
            hidden = self.model.hidden_states(local, self.cache, sequence=cp, positions=cp.positions(self._device))
            if not self.is_owner:
                # what the prefill left here describes the end of this rank's chunk, which no token follows
                for layer in self.cache.layers:
                    layer.conv_state = layer.value_state = None
            self.shard_lengths = [layout.chunk_len] * self.size
            self.position = sharded
            if sharded == T:
                # the last prompt token's hidden state lives on the owner; [B, D] is smaller than [B, V]
                last = hidden[:, -1].contiguous() if self.is_owner else hidden.new_empty(hidden[:, -1].shape)
                self._broadcast(last, "prefill")
                logits = self.model.logits(last)
        for t in range(sharded, T):
            logits = self.step(prompt_ids[:, t])
        return logits

    @torch.inference_mode()
    def attach(self, cache: DecodeCache, position: int) -> None:
        """Decode on from caches filled elsewhere: `cache` holds this rank's shard of a sequence of `position`
        tokens (the owner's with its convolution and value-shift states); a sliding block's, the ring of its
        shard's own positions (the shard appended to `AttentionCache(window)` from its count 0, as a sharded
        prefill leaves it). One all-gather learns the shard lengths of every rank."""
        length = torch.tensor([cache.length], dtype=torch.long, device=self._device)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        dist.all_gather(lengths, length, group=self.group)
        self.shard_lengths = [int(n) for n in lengths]
        if sum(self.shard_lengths) != position:
            raise ZayaError(f"the ranks' caches hold {sum(self.shard_lengths)} tokens, not {position}")
        self.cache, self.position = cache, position

    @torch.inference_mode()
    def step(self, token: Tensor) -> Tensor:
        """Feed one token per row [B] (the same on every rank); returns the logits [B, V] after it."""
        model = self.model
        if self.position >= model.config.max_position_embeddings:
            raise ZayaError(f"the sequence has reached the model's max_position_embeddings "
                            f"({model.config.max_position_embeddings:,}): no position is left for another token")
        ids = token.to(self._device).view(-1, 1)
        positions = torch.tensor([self.position], device=self._device)
        ropes = model.rope(positions)
        self.shard_lengths[self.owner] += 1  # every layer appends this token on the owner before attending
        h = model.embed_scaling(model.embed(ids))
        router_state = None
        for i, (block, cache) in enumerate(zip(model.blocks, self.cache.layers, strict=True)):
            a = self._attention(i, block.attn, block.attn_norm(h), ropes[block.layer_type], cache)
            h, router_state = block.after_attention(a, h, router_state)
        self.position += 1
        return model.logits(model.norm(h)[:, -1])

    def agree(self, token: Tensor) -> Tensor:
        """The owner's choice of next token [B], on every rank."""
        token = token.contiguous()
        self._broadcast(token, "token")
        return token

    # ---- one attention layer ----------------------------------------------------------------------------

    def reach(self, window: int | None) -> list[int]:
        """How many of each rank's positions the current token (at `self.position`, already counted in the
        owner's shard) sees in a block of sliding `window` (None: all of them). The shards are consecutive
        runs, so each rank's count is a suffix of its shard."""
        if window is None:
            return list(self.shard_lengths)
        first = self.position - window + 1  # the window's first position
        seen, start = [], 0
        for length in self.shard_lengths:
            seen.append(max(0, min(length, start + length - first)))
            start += length
        return seen

    def _attention(self, layer: int, attn: CompressedConvAttention, x: Tensor,
                   rope: tuple[Tensor, Tensor, Tensor], cache: AttentionCache) -> Tensor:
        B = x.shape[0]
        Hq, Hk, d = attn.num_q_heads, attn.num_kv_heads, attn.head_dim
        dtype = attn.temp.dtype  # project()'s
        if self.is_owner:
            q, k, v, cache.conv_state, cache.value_state = attn.project(x, rope, cache.conv_state, cache.value_state)
            cache.append(k, v)
            q = q.contiguous()
        else:
            q = x.new_empty((B, Hq, 1, d), dtype=dtype)
        seen = self.reach(attn.window)
        keys, values = _visible(cache, seen[self.rank], (B, Hk, 0, d), dtype, self._device)
        if attn.window is not None and sum(seen) == seen[self.owner]:
            # the window lies within the owner's shard: it attends alone and sends the output, the query's size
            if self.is_owner:
                out = self._local(q.view(B, Hk, Hq // Hk, 1, d), keys, values)[0].to(dtype).view(B, Hq, 1, d)
                self.attended[layer] += seen[self.owner]
            else:
                out = q
            self._broadcast(out, "window_out")
        else:
            self._broadcast(q, "query")
            q5 = q.view(B, Hk, Hq // Hk, 1, d)
            if self.kernel == "tree":
                out = self._tree(q5, keys, values)
                self.attended[layer] += seen[self.rank]
            else:  # every shard comes by
                out = self._ring(q5, keys, values, seen)
                self.attended[layer] += sum(seen)
            out = out.to(dtype).view(B, Hq, 1, d)
        return attn.o_proj(out.transpose(1, 2).reshape(B, 1, -1))

    def _local(self, q5: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """(out, lse) of the query over one shard's keys and values, in the accumulation dtype."""
        if keys.shape[2] == 0:
            # softmax over nothing: weight exp(-inf - M) = 0 in the reduction, and no 0/0 on the way there
            acc = torch.promote_types(q5.dtype, torch.float32)
            return q5.new_zeros(q5.shape, dtype=acc), q5.new_full(q5.shape[:-1], float("-inf"), dtype=acc)
        return block_forward(q5, keys, values, False, 1.0 / math.sqrt(q5.shape[-1]))

    def _tree(self, q5: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        out, lse = self._local(q5, keys, values)
        top = lse.clone()
        all_reduce(top, self.group, self.counter, "tree_max", dist.ReduceOp.MAX)
        # the owner has just appended a key, so top is finite and every weight is in [0, 1]
        weight = torch.exp(lse - top)[..., None]
        packed = torch.cat([out * weight, weight], dim=-1)
        all_reduce(packed, self.group, self.counter, "tree_sum")
        return packed[..., :-1] / packed[..., -1:]

    def _ring(self, q5: Tensor, keys: Tensor, values: Tensor, lengths: list[int]) -> Tensor:
        """`lengths`: the keys each rank's shard brings (`reach`), which every rank knows."""
        held, origin = torch.stack([keys, values]), self.rank  # the shard in hand, and whose it is
        acc = None
        for hop in range(self.size):
            pending = None
            if hop < self.size - 1:  # post the next transfer before this shard's block is computed
                source = (self.rank - hop - 1) % self.size
                incoming = held.new_empty((*held.shape[:3], lengths[source], held.shape[-1]))
                # an empty shard is not sent; its receiver knows its length and does not wait for it
                pending = (incoming, source, ring_shift(held, incoming, self.group, self.counter, "ring_kv"))
            if lengths[origin]:
                acc = merge(acc, *block_forward(q5, held[0], held[1], False, 1.0 / math.sqrt(q5.shape[-1])))
            if pending is not None:
                held, origin, requests = pending
                for request in requests:
                    request.wait()
        return acc[0]

    def _broadcast(self, tensor: Tensor, kind: str) -> None:
        broadcast(tensor, self.owner, self.group, self.counter, kind)


def _visible(cache: AttentionCache, n: int, empty_shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> tuple[Tensor, Tensor]:
    """The keys and values [B, Hk, n, d] of the last `n` positions a layer's cache holds (in any order: a
    decode query sees them all alike). n = 0 on a rank the window does not reach, or that holds none yet (a
    prompt too short to shard leaves every rank but the owner empty)."""
    if cache.keys is None:
        empty = torch.empty(empty_shape, dtype=dtype, device=device)
        return empty, empty
    if n == 0 or n == cache.stored:  # none, or every key held: a full block's first n slots, a ring's written ones
        return cache.keys[:, :, :n], cache.values[:, :, :n]
    slots = torch.arange(cache.length - n, cache.length, device=cache.keys.device) % cache.window
    return cache.keys.index_select(2, slots), cache.values.index_select(2, slots)


@torch.inference_mode()
def generate_sharded(
    model: Zaya,
    prompt_ids: Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    kernel: str = "tree",
    eos_token_id: int | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    counter: CommCounter | None = None,
    allowed: Tensor | None = None,
) -> Tensor:
    """`zaya.infer.generate.generate` with the KV cache split along the sequence over `group`: every rank
    calls it with the same model and arguments and gets the same tokens [B, n]; a seeded sampling draws the
    same tokens as the single-process `generate` (each rank draws from its own generator of that seed, and
    the owner's choice is broadcast). See the module docstring for the kernels."""
    sampling = sampling or Sampling()
    if not isinstance(sampling, Sampling):
        raise ZayaError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    check_prompt(prompt_ids, model.config.vocab_size)
    check_length(model.config, prompt_ids.shape[1], max_new_tokens)
    check_allowed(allowed, model.config.vocab_size)
    decoder = ShardedDecoder(model, group, kernel=kernel, counter=counter)
    device = model.embed.weight.device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    logits = decoder.prefill(prompt_ids)
    allowed = allowed.to(device) if allowed is not None else None
    return decode_loop(logits, decoder.step, max_new_tokens, sampling, generator, eos_token_id=eos_token_id,
                       on_token=on_token, agree=decoder.agree, prompt_ids=prompt_ids, allowed=allowed)
