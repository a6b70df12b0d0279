"""Compressed Convolutional Grouped-Query Attention (CCGQA), spec section 4, and its decode cache.

Per token t (x_t is the RMSNorm'd stream, j = h // g the KV head of query head h):

    1. q~_t = W_q x_t,  k~_t = W_k x_t
    2. mu^q_{t,h} = (q~_{t,h} + k~_{t,j}) / 2,   mu^k_{t,j} = mean over the g heads of group j of mu^q_{t,h}
    3. p_t = [q~_t | k~_t], left-padded with zeros; two causal convolutions over time:
         y_t = sum_i w0[i] * p_{t-k0+1+i} + b0                (depthwise)
         z_t = sum_j A_j y_{t-k1+1+j} + b1                    (per head: A_j block-diagonal, one block per head)
       the intermediate y is not re-padded, so for ZAYA1's kernels y_{-1} = b0, not 0. Both are linear, so
       they compose into one causal convolution of kernel k0 + k1 - 1 per head (see `conv_kernel`).
    4. q_t = z^q_t + mu^q_t,  k_t = z^k_t + mu^k_t
    5. value shift: v_t = [W_vcur x_t | W_vdel x_{t-1}] (x_{-1} = 0): the first half of the KV heads read the
       current token, the second half the previous one.
    6. q^ = sqrt(d) q / |q|,  k^_j = sqrt(d) tau_j k_j / |k_j|     (per-KV-head temperature tau)
    7. partial NeoX RoPE on the first rotary_dim dims of q^ and k^
    8. causal softmax attention of the query heads over the shared KV heads, scale 1/sqrt(d); then W_o.
"""

from __future__ import annotations

import math
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from zaya.model.config import ZayaConfig
from zaya.model.documents import Documents
from zaya.model.layers import apply_rotary
from zaya.model.packed_attention import packed_attention

_SHORT_INPUT = 8  # tokens up to which the convolutions run as a direct contraction


class SequenceShard(Protocol):
    """A sequence split over several devices (`zaya.parallel.context.ContextParallel`): this device holds
    `segments` contiguous runs of it, of equal length, side by side. The layer keeps its single-device math and
    asks the shard for the two things that cross devices."""

    segments: int

    def exchange_halo(self, tails: torch.Tensor) -> torch.Tensor:
        """[B, segments, n] -> [B, segments, n]: what each segment ends with -> what the run of the global
        sequence just before each segment ends with (zeros before the first token)."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence's keys and values; within a sliding
        `window` where one is given (a `hybrid_sliding` block)."""
        ...


class AttentionCache:
    """Decode state of one attention layer, so that each new token costs O(1) projection and conv work.

    Holds the post-norm, post-RoPE keys and the values [B, n_k, S, d], the last `conv_padding` pre-convolution
    packed vectors p (the convolutions' state) and the last W_vdel x (the value-shift state). A full block's
    keys grow by doubling (S >= every position seen); a sliding block's (`window` W) are a ring of W slots,
    position p in slot p mod W, so its memory stays flat however long the sequence.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0  # positions seen (the position of the next token)
        self.conv_state: torch.Tensor | None = None  # [B, P, C]
        self.value_state: torch.Tensor | None = None  # [B, 1, n_k * d / 2]

    @property
    def stored(self) -> int:
        """Positions whose keys are held: all of them, or a sliding block's last W."""
        return self.length if self.window is None else min(self.length, self.window)

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The held keys and values [B, n_k, stored, d] in position order, and the position of the first."""
        if self.keys is None:
            raise ValueError("an empty decode cache has no keys")
        n = self.stored
        first = self.length - n
        if self.window is None:
            return self.keys[:, :, :n], self.values[:, :, :n], first
        slots = torch.arange(first, self.length, device=self.keys.device) % self.window
        return self.keys.index_select(2, slots), self.values.index_select(2, slots), first

    def append(self, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store the keys and values of T new tokens; return the keys and values to attend over (in position
        order, the new ones last) and the position of the first of them. A full block returns views of every
        key so far; a sliding block the keys it held before (at most W) and the new ones, which then replace
        the oldest in the ring."""
        if self.window is None:
            return (*self._grow(k_BHTd, v_BHTd), 0)
        T = k_BHTd.shape[2]
        self._reserve(k_BHTd, v_BHTd, min(self.length + T, self.window))
        if T == 1 and self.length < self.window:  # filling the ring: its slots are in position order
            slot = self.length
            self.keys[:, :, slot:slot + 1], self.values[:, :, slot:slot + 1] = k_BHTd, v_BHTd
            self.length += 1
            return self.keys[:, :, :self.length], self.values[:, :, :self.length], 0
        if T == 1:  # a full ring: every held key is within the window of the new token, in any order
            slot = self.length % self.window
            self.keys[:, :, slot:slot + 1], self.values[:, :, slot:slot + 1] = k_BHTd, v_BHTd
            self.length += 1
            return self.keys, self.values, -1
        keys, values, first = self.ordered() if self.length else (k_BHTd[:, :, :0], v_BHTd[:, :, :0], 0)
        keys, values = torch.cat([keys, k_BHTd], dim=2), torch.cat([values, v_BHTd], dim=2)
        self.length += T
        keep = min(self.length, self.window)
        slots = torch.arange(self.length - keep, self.length, device=keys.device) % self.window
        self.keys.index_copy_(2, slots, keys[:, :, -keep:])
        self.values.index_copy_(2, slots, values[:, :, -keep:])
        return keys, values, first

    def _reserve(self, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor, slots: int) -> None:
        """At least `slots` slots, grown by doubling (at most W for a ring: a short generation holds no more than
        it needs). A ring grows only before it wraps, while slot = position, so the held keys keep their slots."""
        held = self.keys.shape[2] if self.keys is not None else 0
        if slots <= held:
            return
        capacity = max(slots, 2 * held, 64)
        if self.window is not None:
            capacity = min(capacity, self.window)
        B, H, _, d = k_BHTd.shape
        keys, values = k_BHTd.new_empty(B, H, capacity, d), v_BHTd.new_empty(B, H, capacity, d)
        if self.keys is not None:
            keys[:, :, : self.stored] = self.keys[:, :, : self.stored]
            values[:, :, : self.stored] = self.values[:, :, : self.stored]
        self.keys, self.values = keys, values

    def _grow(self, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k_BHTd.shape[2]
        self._reserve(k_BHTd, v_BHTd, end)
        self.keys[:, :, self.length : end] = k_BHTd
        self.values[:, :, self.length : end] = v_BHTd
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class DecodeCache:
    """The decode state of a whole model: one `AttentionCache` per block (MoE layers need none); `windows[i]`
    is block i's sliding window (None: it attends to every position)."""

    def __init__(self, num_layers: int, windows: list[int | None] | None = None):
        windows = windows if windows is not None else [None] * num_layers
        self.layers = [AttentionCache(window) for window in windows]

    @property
    def length(self) -> int:
        """Tokens seen so far (the position of the next token)."""
        return self.layers[0].length


class CompressedConvAttention(nn.Module):
    """CCGQA: compressed q/k latents mixed by two causal convolutions, q-k mean sharing, value shift,
    L2 q/k norm with a per-KV-head key temperature, and partial RoPE."""

    def __init__(self, config: ZayaConfig, window: int | None = None):
        super().__init__()
        self.window = window  # a sliding block's W: query t sees keys t - W < s <= t; None: every s <= t
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.group_size = config.group_size
        self.kernel0 = config.cca_time0
        self.kernel1 = config.cca_time1
        self.padding = config.conv_padding
        D, Q, K, C = config.hidden_size, config.query_latent, config.key_latent, config.conv_channels

        self.q_proj = nn.Linear(D, Q, bias=False)
        self.k_proj = nn.Linear(D, K, bias=False)
        self.v_cur_proj = nn.Linear(D, K // 2, bias=False)
        self.v_del_proj = nn.Linear(D, K // 2, bias=False)
        # Stored in nn.Conv1d's weight layout, [C_out, C_in / groups, kernel], the layout of the checkpoints.
        self.conv0_weight = nn.Parameter(torch.empty(C, 1, self.kernel0))
        self.conv0_bias = nn.Parameter(torch.zeros(C))
        self.conv1_weight = nn.Parameter(torch.empty(C, self.head_dim, self.kernel1))
        self.conv1_bias = nn.Parameter(torch.zeros(C))
        self.temp = nn.Parameter(torch.full((self.num_kv_heads,), float(config.temp_init)))
        self.o_proj = nn.Linear(Q, D, bias=False)
        self._memo: dict[str, tuple[tuple, tuple, torch.Tensor]] = {}

    # ---- derived weights ----------------------------------------------------------------------------

    def _remember(self, name: str, sources: tuple[torch.Tensor, ...], build) -> torch.Tensor:
        """`build()`, reused while decoding (inference mode) across calls that see the same, unchanged source
        tensors. Only there: in training and its evaluations FSDP2 frees and refills the parameters' storage,
        and a parameter gathered anew can sit at the old address with the old version count (a stale hit once
        gave an evaluation the weights of four steps before); a traced graph computes the result itself."""
        if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
            return build()
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
        cached = self._memo.get(name)
        if cached is None or cached[0] != key or any(ref() is not t for ref, t in zip(cached[1], sources, strict=True)):
            cached = (key, tuple(weakref.ref(t) for t in sources), build())
            self._memo[name] = cached
        return cached[2]

    def input_weight(self) -> torch.Tensor:
        """[W_q; W_k; W_vcur; W_vdel]: all four input projections as one matmul."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_cur_proj.weight, self.v_del_proj.weight)
        return self._remember("input", weights, lambda: torch.cat(weights))

    def conv_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two convolutions of step 3 composed into one causal convolution of kernel P + 1 per head:

            z_t = sum_{m=0..P} M_m p_{t-P+m} + c,   M_m = sum_{i+j=m} A_j diag(w0_i),   c = sum_j A_j b0 + b1

        Exact, the subtlety included: y is only ever computed from the zero-padded p, so y_{-1} = b0.
        Returns M in nn.Conv1d's grouped layout, [C, d, P + 1], and c as [C].
        """
        sources = (self.conv0_weight, self.conv0_bias, self.conv1_weight, self.conv1_bias)
        return self._remember("conv", sources, self._compose_conv)

    def _compose_conv(self) -> tuple[torch.Tensor, torch.Tensor]:
        G, d = self.num_q_heads + self.num_kv_heads, self.head_dim
        A = self.conv1_weight.view(G, d, d, self.kernel1)  # A[g, out, in, j]
        w0 = self.conv0_weight.view(G, 1, d, self.kernel0)  # w0[g, -, in, i]
        taps = [
            sum(A[..., j] * w0[..., m - j] for j in range(self.kernel1) if 0 <= m - j < self.kernel0)
            for m in range(self.padding + 1)
        ]
        M = torch.stack(taps, dim=-1).reshape(G * d, d, self.padding + 1)
        c = torch.einsum("goij,gi->go", A, self.conv0_bias.view(G, d)).reshape(-1) + self.conv1_bias
        return M, c

    def derived_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(`input_weight()`, *`conv_kernel()`): what the forward pass multiplies by, for a caller that holds
        them across calls (the compiled decode step, which cannot use the memo)."""
        return (self.input_weight(), *self.conv_kernel())

    def _convolve(self, p_ext: torch.Tensor, T: int, M: torch.Tensor, c: torch.Tensor,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
        """z [B, T, heads, d] from the padded packed sequence p_ext [B, T + P, C] and the composed kernel; with
        `documents` (positions in documents, [B, T]) no window reaches across a document's start."""
        B, G, d, P = p_ext.shape[0], self.num_q_heads + self.num_kv_heads, self.head_dim, self.padding
        M, c = M.to(p_ext.dtype), c.to(p_ext.dtype)
        if T <= _SHORT_INPUT or documents is not None:
            # a few tokens (decoding): a contraction over each window beats a convolution's setup cost; packed
            # documents: window slot m holds p_{t-P+m}, which t's document reaches if P - m <= pos_t
            if documents is None:
                windows = p_ext.unfold(1, P + 1, 1)
            else:  # stacked slices, not unfold: inductor's CPU code corrupts memory in a masked unfold's backward
                windows = torch.stack([p_ext[:, m:m + T] for m in range(P + 1)], dim=-1)
                reach = documents[:, :, None] >= torch.arange(P, -1, -1, device=documents.device)
                windows = windows * reach[:, :, None, :].to(windows.dtype)
            windows = windows.reshape(B, T, G, d, P + 1)
            return torch.einsum("btgim,goim->btgo", windows, M.view(G, d, d, P + 1)) + c.view(G, d)
        z = F.conv1d(p_ext.transpose(1, 2), M, c, groups=G)
        # back to [B, T, heads, d] with d contiguous (the fused attention kernels need it): one converting copy
        return z.new_empty((B, T, G * d), dtype=p_ext.dtype).copy_(z.transpose(1, 2)).view(B, T, G, d)

    # ---- forward ------------------------------------------------------------------------------------

    def project(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        conv_past: torch.Tensor | None = None,
        value_past: torch.Tensor | None = None,
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        sequence: SequenceShard | None = None,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-7 for T new tokens, after `conv_past` (the last P packed vectors p, [B, P, C]) and
        `value_past` (the last W_vdel x, [B, 1, n_k d / 2]); None means the sequence starts here.
        `weights` are `derived_weights()`, when the caller has them. With a `sequence` shard, x holds its
        segments and the states before each come from `sequence.exchange_halo` (the two pasts must be None).
        `documents`: each token's position in its packed document [B, T] (`zaya.model.documents`): with a
        `sequence` shard, of x's tokens (a segment's first tokens reach back into the halo only as far as their
        document does); no pasts.

        Returns q [B, n_q, T, d], k and v [B, n_k, T, d], and the two states after these tokens.
        """
        B, T, _ = x_BTD.shape
        Hq, Hk, d, g, P = self.num_q_heads, self.num_kv_heads, self.head_dim, self.group_size, self.padding
        Q, K = Hq * d, Hk * d
        # Elementwise math runs in the parameters' dtype (fp32 masters under autocast, bf16 for a bf16 model);
        # only the matmuls drop to the autocast dtype.
        dtype = self.temp.dtype
        W_in, M, c = weights if weights is not None else self.derived_weights()

        # 1. compressed projections (and both value projections) as one matmul
        p, v_cur, v_del_now = F.linear(x_BTD, W_in).to(dtype).split([Q + K, K // 2, K // 2], dim=-1)

        # 2. q-k mean sharing (pre-convolution residuals), for the query heads and then the key heads
        mu_q = (p[..., :Q].reshape(B, T, Hk, g, d) + p[..., Q:].reshape(B, T, Hk, 1, d)) * 0.5
        mu = torch.cat([mu_q.reshape(B, T, Hq, d), mu_q.mean(dim=3)], dim=2)

        # Each run of consecutive tokens (one, unless the sequence is sharded) is a row of its own for the
        # convolutions and the value shift, which reach back P tokens and one token across its start.
        S = sequence.segments if sequence is not None else 1
        rows, L = B * S, T // S
        p_rows, v_del_rows = p.reshape(rows, L, Q + K), v_del_now.reshape(rows, L, K // 2)
        if sequence is not None:
            if L < P:
                raise ValueError(f"a shard of {L} tokens per segment is shorter than the {P} tokens the "
                                 "convolutions reach back")
            tails = torch.cat([p_rows[:, L - P:].reshape(B, S, P * (Q + K)), v_del_rows[:, -1].view(B, S, K // 2)],
                              dim=-1)
            conv_past, value_past = sequence.exchange_halo(tails).reshape(rows, -1).split(
                [P * (Q + K), K // 2], dim=-1)
            conv_past, value_past = conv_past.view(rows, P, Q + K), value_past.view(rows, 1, K // 2)

        # 3. the causal convolutions over p_t = [q~_t | k~_t]; their state is the last P vectors of p
        past = p.new_zeros(rows, P, Q + K) if conv_past is None else conv_past.to(dtype)
        p_ext = torch.cat([past, p_rows], dim=1)
        reach = None if documents is None else documents.reshape(rows, L)
        z = self._convolve(p_ext, L, M, c, reach).to(dtype).reshape(B, T, Hq + Hk, d)

        # 4. add the mean-shared residuals back: q and k heads side by side, [B, T, Hq + Hk, d]
        qk = z + mu

        # 5. value shift: KV heads 0..Hk/2-1 read the current token, the rest the previous one
        v_prev = v_del_now.new_zeros(rows, 1, K // 2) if value_past is None else value_past.to(dtype)
        v_del = torch.cat([v_prev, v_del_rows[:, :-1]], dim=1).reshape(B, T, K // 2)
        if documents is not None:  # a document's first token has no previous token
            v_del = v_del * (documents >= 1)[..., None].to(dtype)
        v = torch.cat([v_cur, v_del], dim=-1).view(B, T, Hk, d)

        # 6. L2 normalisation to length sqrt(d), then the key temperature (queries: 1)
        eps = torch.finfo(qk.dtype).eps
        qk = qk * (math.sqrt(d) / qk.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        qk = qk * torch.cat([self.temp.new_ones(Hq), self.temp]).to(dtype)[:, None]

        # 7. partial RoPE at absolute positions
        qk = apply_rotary(qk, *rope).transpose(1, 2)
        # the states after the last token (of the last segment, with a sequence shard)
        return qk[:, :Hq], qk[:, Hq:], v.transpose(1, 2), p_ext.view(B, S, L + P, -1)[:, -1, L:], v_del_now[:, -1:]

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cache: AttentionCache | None = None,
        sequence: SequenceShard | None = None,
        documents: Documents | None = None,
        band: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rope` is (cos, sin, partner) from `RotaryEmbedding` for the positions of x's tokens. With a
        `sequence` shard, x is this device's part of a sequence; a `cache` then keeps this part's keys and
        values (a sharded prefill). `documents`: x holds packed documents (`zaya.model.documents.Documents`),
        without a decode cache; with a shard, the shard's attention keeps them apart. `band`: a sliding block's
        plan for rows of x's length from their first position (`zaya.model.masks.window_segments`), made
        outside a compiled graph; without it a sliding block over a longer sequence than its window forms an
        explicit mask."""
        B, T, _ = x_BTD.shape
        if documents is not None and cache is not None:
            raise ValueError("packed documents are for training and evaluation: not with a decode cache")
        plan = None
        if documents is not None and sequence is None:
            plan = documents.segments if self.window is None else documents.sliding
            if plan is None:
                raise ValueError(f"Documents.{'segments' if self.window is None else 'sliding'} is None: packed "
                                 "documents on one device need their attention's segments "
                                 "(zaya.model.documents.packed_documents plans them)")
        conv_past, value_past = (cache.conv_state, cache.value_state) if cache is not None else (None, None)
        if sequence is not None:
            conv_past = value_past = None
        positions = None if documents is None else documents.positions
        q, k, v, conv_state, value_state = self.project(x_BTD, rope, conv_past, value_past, sequence=sequence,
                                                         documents=positions)
        first_key = 0  # the position of k's first key (-1: a full ring of a sliding block, every key visible)
        past_len = 0
        if cache is not None:
            cache.conv_state, cache.value_state = conv_state.detach(), value_state.detach()
            past_len = cache.length
            if sequence is None:
                k, v, first_key = cache.append(k, v)
            else:
                cache.append(k, v)
        # 8. grouped-query causal attention (over the cache when decoding, over every shard's keys for a
        # sharded sequence; within the window in a sliding block), then W_o
        if sequence is not None:
            out = sequence.attention(q, k, v) if self.window is None else sequence.attention(q, k, v, self.window)
        elif documents is not None:
            first = torch.arange(T, device=positions.device) - positions
            out = packed_attention(q, k, v, plan, first, self.window)
        elif band is not None and past_len == 0:
            no_documents = torch.zeros(B, 0, dtype=torch.long, device=q.device)
            out = packed_attention(q, k, v, band, no_documents, self.window)
        else:
            out = _causal_attention(q, k, v, past_len, first_key, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, first_key: int = 0,
                      window: int | None = None) -> torch.Tensor:
    """Softmax attention of q [B, Hq, T, d] (positions past_len ..) over k, v [B, Hk, S, d] (positions first_key
    .. past_len + T - 1; -1: a sliding block's full ring, every key visible to its one query), causal in
    absolute positions and within `window`."""
    T, S = q.shape[2], k.shape[2]
    if T == 1 and (window is None or first_key < 0 or window >= S):  # a branch, not `is_causal=T > 1`: in a
        # graph of varying length T is symbolic, which the kernel does not take; the branch guards on it
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if past_len == 0 and (window is None or window >= T):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    t = past_len + torch.arange(T, device=q.device)[:, None]
    s = first_key + torch.arange(S, device=q.device)[None, :]
    allowed = s <= t
    if window is not None:
        allowed &= t - s < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
