"""Named model shapes: the one complexity dial of the model family.

`micro` and `mini` are the smallest faithful configs of the spec (section 12: every feature kept); `tiny` and
`small` are CPU training sizes; `zaya1-base` and `zaya1-8b` are the published shapes; `zaya1-sliding`, a design of
ours and no published checkpoint, is ZAYA1-8B with three blocks of every four attending through a sliding window
of 4,096 positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.schema import shown

_ZAYA1_SHAPE = dict(
    vocab_size=262_272,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    num_experts=16,
    moe_intermediate_size=2048,
    router_hidden_size=256,
    pad_token_id=0,
    bos_token_id=2,
)

PRESETS: dict[str, dict] = {
    "micro": dict(
        vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, moe_intermediate_size=64, router_hidden_size=32,
    ),
    "mini": dict(
        vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, moe_intermediate_size=128, router_hidden_size=64,
    ),
    "tiny": dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, moe_intermediate_size=256, router_hidden_size=64,
    ),
    "small": dict(
        vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, num_experts=16, moe_intermediate_size=512, router_hidden_size=128,
    ),
    # ZAYA1-base: the legacy checkpoint (identity-gated skip route), RoPE base 1e6, 32k positions, eos 1.
    "zaya1-base": dict(
        _ZAYA1_SHAPE, rope_theta=1_000_000.0, max_position_embeddings=32_768, eos_token_id=1, skip_route="identity",
    ),
    # ZAYA1-8B: the HF-native checkpoint, RoPE base 5e6, 131k positions, eos <end_of_turn> = 106.
    "zaya1-8b": dict(
        _ZAYA1_SHAPE, rope_theta=5_000_000.0, max_position_embeddings=131_072, eos_token_id=106, skip_route="zero",
    ),
    # Our design, not a published model: ZAYA1-8B's shape and RoPE with three blocks of every four attending to
    # the last 4,096 positions only (hybrid_sliding) and every fourth, the last included, to the whole context.
    # At 131k positions a sliding block's attention has 1/16 of a full block's query-key pairs (a causal row's
    # query sees 65k keys on average, a window's at most 4,096), and its decode cache holds 4,096 positions
    # instead of 131k. The sliding blocks' RoPE base is transformers' default for the type, 1e4, that of the 4k
    # pretraining in configs/zaya1-base.toml; the full blocks keep ZAYA1-8B's 5e6 for 131k.
    "zaya1-sliding": dict(
        _ZAYA1_SHAPE, rope_theta=5_000_000.0, max_position_embeddings=131_072, eos_token_id=106, skip_route="zero",
        layer_types=(["hybrid_sliding"] * 3 + ["hybrid"]) * 10, sliding_window=4096, sliding_rope_theta=10_000.0,
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **overrides) -> ZayaConfig:
    """The named preset as a config; `overrides` replace fields (e.g. `temp_init=0.0`, the public code's init)."""
    if name not in PRESETS:
        raise ZayaError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
    return ZayaConfig(**{**PRESETS[name], **overrides})


@dataclass
class ModelSection:
    """`[model]` of a run config: a preset, and any model field to override."""

    preset: str = "tiny"  # the model's shape: a name in zaya.model.presets.PRESETS
    # Any ZayaConfig field, replacing the preset's value (e.g. temp_init, fp32_logits, rope_theta).
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, source: str) -> ZayaConfig:
        if self.preset not in PRESETS:
            raise ZayaError(f"{source}: model.preset {shown(self.preset)} does not exist (known: {', '.join(PRESETS)})")
        known = {f.name for f in dataclasses.fields(ZayaConfig)}
        for key in self.overrides:
            if key not in known:
                raise ZayaError(f"{source}: unknown key {shown('model.' + key)}")
        return ZayaConfig.from_dict({**PRESETS[self.preset], **self.overrides}, f"{source}: [model]")
