"""The ZAYA1 decoder in its native form (spec section 3.1): 40 blocks of CCGQA attention + MoE.

    h_0     = (e + b_in) * s_in                                           (fp32 from here on)
    a_l     = CCA_l(RMSNorm(h_l))                                         (a `hybrid_sliding` block: within its
                                                                           window, with its own RoPE)
    u_l     = (a_l + b^A_o) * s^A_o + (h_l + b^A_h) * s^A_h               (residual scaling)
    m_l, r_l = MoE_l(RMSNorm(u_l), r_{l-1})                               (r: router state, EDA)
    h_{l+1} = (m_l + b^M_o) * s^M_o + (u_l + b^M_h) * s^M_h
    logits  = RMSNorm(h_L) E^T                                            (tied embeddings; fp32 optionally)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from zaya.model.attention import AttentionCache, CompressedConvAttention, DecodeCache, SequenceShard
from zaya.model.config import ZayaConfig
from zaya.model.documents import Documents
from zaya.model.groups import ParameterGroup, parameter_groups
from zaya.model.layers import EmbeddingScaling, ResidualScaling, RMSNorm, RotaryEmbedding
from zaya.model.loss import linear_cross_entropy
from zaya.model.masks import window_segments
from zaya.model.moe import Experts, ZayaMoE, expert_counts
from zaya.model.router import Routing, ZayaRouter, initial_balancing_biases


class RouterStats:
    """Collects what the routers decided during one or more forward passes, on the device (no host syncs).

    `counts[l, i]` is how many tokens MoE layer l sent to route i (the last column is the skip route),
    `entropy_sum[l]` the summed entropy of its routing distributions, `tokens` the tokens seen per layer.
    The blocks measure (`measure`) and the model's loop records, outside the blocks: a compiled block's code is
    then the same for every layer, and a checkpointed block that runs its forward again in backward records
    nothing twice.
    """

    def __init__(self, num_layers: int, num_routes: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(num_layers, num_routes, dtype=torch.int64, device=device)
        self.entropy_sum = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.tokens = 0

    @staticmethod
    def measure(routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's route counts [E + 1] and summed routing entropy (fp64), for `record`."""
        with torch.no_grad():
            p = routing.probs
            entropy = -(p * torch.log(p.clamp_min(1e-30))).sum().double()
            return expert_counts(routing.route, p.shape[-1]), entropy

    def record(self, layer: int, measured: tuple[torch.Tensor, torch.Tensor], tokens: int) -> None:
        counts, entropy = measured
        self.counts[layer] += counts
        self.entropy_sum[layer] += entropy
        if layer == 0:
            self.tokens += tokens


class ZayaBlock(nn.Module):
    """One native block: attention sublayer and MoE sublayer, each merged by residual scaling."""

    def __init__(self, config: ZayaConfig, index: int):
        super().__init__()
        self.index = index
        self.layer_type = config.layer_type(index)
        self.window = config.window(index)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = CompressedConvAttention(config, self.window)
        self.attn_residual = ResidualScaling(config.hidden_size)
        self.moe_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = ZayaMoE(config, use_eda=index > 0)
        self.moe_residual = ResidualScaling(config.hidden_size)

    def forward(
        self,
        h: torch.Tensor,
        router_state: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cache: AttentionCache | None = None,
        sequence: SequenceShard | None = None,
        *,
        measure: bool = False,
        documents: Documents | None = None,
        band: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The new stream, the router state, and with `measure` the routing's statistics (`RouterStats.measure`).
        `documents`: h holds packed documents (`zaya.model.documents.Documents`); `band`: a sliding block's plan
        (`CompressedConvAttention.forward`)."""
        a = self.attn(self.attn_norm(h), rope, cache, sequence, documents, band)
        h, routing = self._after_attention(a, h, router_state)
        return h, routing.state, RouterStats.measure(routing) if measure else None

    def after_attention(
        self, a: torch.Tensor, h: torch.Tensor, router_state: torch.Tensor | None, *, gathered: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the block once the attention output `a` of stream `h` is known: its merge, the MoE
        sublayer and its merge (`gathered`: see `ZayaMoE.forward`). Returns the new stream and router state."""
        h, routing = self._after_attention(a, h, router_state, gathered=gathered)
        return h, routing.state

    def _after_attention(
        self, a: torch.Tensor, h: torch.Tensor, router_state: torch.Tensor | None, *, gathered: bool = False
    ) -> tuple[torch.Tensor, Routing]:
        u = self.attn_residual(a, h)
        m, routing = self.moe(self.moe_norm(u), router_state, gathered=gathered)
        return self.moe_residual(m, u), routing


def _copy_from(source: torch.Tensor, tensor: torch.Tensor) -> None:
    tensor.copy_(source)


class Zaya(nn.Module):
    """A ZAYA1-style MoE language model. `model(ids)` maps token ids [B, T] to logits [B, T, V]."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        # built on the meta device, then allocated and initialised once: the random draws are `initializers`'
        # alone (not also those of each layer's constructor), so that a sharded model built shard by shard
        # draws the same stream (`zaya.parallel.materialize`)
        with torch.device("meta"):
            # an explicit weight skips nn.Embedding's own draw, whose meta kernel costs the first caller of a
            # process over a second (it loads the compiler's decompositions)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size,
                                      _weight=torch.empty(config.vocab_size, config.hidden_size))
            self.embed_scaling = EmbeddingScaling(config.hidden_size)
            self.rotary = RotaryEmbedding(config.head_dim, config.rotary_dim, config.rope_theta)
            # the sliding blocks' own RoPE (transformers: `rope_parameters["hybrid_sliding"]`), where there are any
            self.sliding_rotary = None if not config.sliding_blocks else RotaryEmbedding(
                config.head_dim, config.sliding_rotary_dim, config.sliding_rope_theta)
            self.blocks = nn.ModuleList(ZayaBlock(config, i) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.to_empty(device=device)
        if device.type != "meta":  # a meta tensor holds no values (and its draws would cost a second)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as the HF-native code does (spec section 8): `initializers`, applied in place."""
        for tensor, fill in self.initializers():
            fill(tensor)

    def initializers(self) -> Iterator[tuple[torch.Tensor, Callable[[torch.Tensor], object]]]:
        """Every parameter and buffer with what sets it, in the order of the random draws: N(0,
        initializer_range) for every matrix, the embedding, the experts and the convolutions; zeros for biases;
        ones for norms, scales and EDA gammas; `temp_init` for the key temperatures; balancing biases 0 with
        the skip route at -1; RoPE's tables. A sharded model built on the meta device applies each to a whole
        tensor and keeps its shard (`zaya.parallel.materialize`), so that its values are one process's."""
        normal = functools.partial(nn.init.normal_, mean=0.0, std=self.config.initializer_range)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                yield module.weight, normal
                if getattr(module, "bias", None) is not None:
                    yield module.bias, nn.init.zeros_
            elif isinstance(module, Experts):
                yield module.gate_up_proj, normal
                yield module.down_proj, normal
            elif isinstance(module, CompressedConvAttention):
                yield module.conv0_weight, normal
                yield module.conv1_weight, normal
                yield module.conv0_bias, nn.init.zeros_
                yield module.conv1_bias, nn.init.zeros_
                yield module.temp, functools.partial(torch.Tensor.fill_, value=self.config.temp_init)
            elif isinstance(module, RMSNorm):
                yield module.weight, nn.init.ones_
            elif isinstance(module, ResidualScaling):
                yield from ((scale, nn.init.ones_) for scale in (module.branch_scale, module.stream_scale))
                yield from ((bias, nn.init.zeros_) for bias in (module.branch_bias, module.stream_bias))
            elif isinstance(module, EmbeddingScaling):
                yield module.scale, nn.init.ones_
                yield module.bias, nn.init.zeros_
            elif isinstance(module, ZayaRouter):
                if module.router_states_scale is not None:
                    yield module.router_states_scale, nn.init.ones_
                biases = initial_balancing_biases(module.num_experts)
                yield module.balancing_biases, functools.partial(_copy_from, biases)
            elif isinstance(module, RotaryEmbedding):
                yield from module.initializers()

    def parameter_groups(self) -> list[ParameterGroup]:
        """The parameters in the groups an optimizer treats alike (`zaya.model.groups`)."""
        return parameter_groups(self, ZayaBlock)

    def new_cache(self) -> DecodeCache:
        """An empty decode cache for `forward(..., cache=...)`: a ring of W positions for each sliding block."""
        return DecodeCache(len(self.blocks), [block.window for block in self.blocks])

    def rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """RoPE's (cos, sin, partner) at `positions` for each block type the model has, by type."""
        tables = {"hybrid": (*self.rotary(positions), self.rotary.partner)}
        if self.sliding_rotary is not None:
            tables["hybrid_sliding"] = (*self.sliding_rotary(positions), self.sliding_rotary.partner)
        return tables

    def restore_rope(self) -> None:
        """Recompute RoPE's tables from the config (they are non-persistent buffers: a model materialised from
        meta, or loaded, needs them)."""
        self.rotary.set_base(self.config.rope_theta)
        if self.sliding_rotary is not None:
            self.sliding_rotary.set_base(self.config.sliding_rope_theta)

    def set_rope_theta(self, base: float) -> None:
        """Change the RoPE base of the `hybrid` blocks (a context-extension phase raises it; sliding blocks,
        which see no further than their window, keep theirs)."""
        self.config.rope_theta = float(base)
        self.rotary.set_base(float(base))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        cache: DecodeCache | None = None,
        router_stats: RouterStats | None = None,
        sequence: SequenceShard | None = None,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states [B, T, D], before the tied LM head. With a `sequence` shard the ids
        are this device's part of a longer sequence, at global `positions` [T]. With `documents` each row holds
        packed documents, computed as if alone (`zaya.model.documents.Documents`; with a shard, of its tokens):
        each token's position in its document is also its RoPE position."""
        T = input_ids.shape[1]
        if documents is not None:
            positions = documents.positions
        elif positions is None:
            past = cache.length if cache is not None else 0
            positions = torch.arange(past, past + T, device=input_ids.device)
        ropes = self.rope(positions)
        band = None
        W = self.config.sliding_window
        if self.sliding_rotary is not None and documents is None and sequence is None and T > W and (
                cache is None or cache.length == 0):
            band = window_segments(T, W)
        h = self.embed_scaling(self.embed(input_ids))
        router_state = None
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            h, router_state, measured = block(h, router_state, ropes[block.layer_type], layer_cache, sequence,
                                              measure=router_stats is not None, documents=documents,
                                              band=band if block.window is not None else None)
            if measured is not None:
                router_stats.record(i, measured, input_ids.numel())
        return self.norm(h)

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """The tied LM head; in fp32 when `config.fp32_logits` (then untouched by autocast)."""
        if self.config.fp32_logits:
            with torch.autocast(hidden_BTD.device.type, enabled=False):
                return F.linear(hidden_BTD.float(), self.embed.weight.float())
        return F.linear(hidden_BTD, self.embed.weight)

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        *,
        router_stats: RouterStats | None = None,
        chunk_rows: int | None = None,
        sequence: SequenceShard | None = None,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of `targets` [B, T] (-100 = ignored), without materialising logits.
        With a `sequence` shard: over this device's part of the sequence (ids, targets and their positions).
        `documents`: packed documents kept apart (see `hidden_states`)."""
        hidden = self.hidden_states(input_ids, router_stats=router_stats, sequence=sequence, positions=positions,
                                    documents=documents)
        return linear_cross_entropy(
            hidden.flatten(0, 1), self.embed.weight, targets.flatten(),
            fp32_logits=self.config.fp32_logits, chunk_rows=chunk_rows,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DecodeCache | None = None,
        *,
        router_stats: RouterStats | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for token ids [B, T]. With a `cache`, the ids continue what it has seen."""
        return self.logits(self.hidden_states(input_ids, cache, router_stats))
