"""The model's shape and numerics: one typed dataclass, validated on construction.

Field names follow the Hugging Face native ZAYA config (`hidden_size`, `num_hidden_layers`, ...), so a
`config.json` maps onto it field by field; the few fields of our own are documented where they are declared.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from zaya.errors import ZayaError
from zaya.ranges import Range
from zaya.schema import shown

SkipRoute = Literal["zero", "identity"]
# The two block types of the ZAYA family's schema: CCA attending to every earlier position, and the same layer
# attending to the last `sliding_window` positions only (transformers' `layer_types` entries).
LAYER_TYPES = ("hybrid", "hybrid_sliding")


# Upper bounds on the shape fields, checked before anything is counted or allocated: far above any model this
# code can train (ZAYA1-base: vocabulary 262,272, width 2,048, 40 blocks, 16 experts), low enough that a stray
# digit is one line instead of a process that fills the memory (even `zaya params` loops over the layers).
SIZE_LIMITS = {
    "vocab_size": 2**24, "hidden_size": 2**17, "num_hidden_layers": 2**12, "num_attention_heads": 2**12,
    "num_key_value_heads": 2**12, "head_dim": 2**12, "num_experts": 2**14, "moe_intermediate_size": 2**20,
    "router_hidden_size": 2**16, "cca_time0": 2**6, "cca_time1": 2**6, "max_position_embeddings": 2**26,
    "sliding_window": 2**26,
}
# The ranges of the float fields: wide around every published value (ZAYA1: RoPE base 1e6 and 5e6, epsilon 1e-5,
# init 0.02, key temperature 0 or 1), narrow enough that a value in the wrong unit or a typo (an init range of
# 1e30, an epsilon that rounds to 0 in fp32, a RoPE base whose frequencies overflow) is one line instead of a
# model that trains on NaN.
FLOAT_RANGES = {
    "partial_rotary_factor": Range(0.0, 1.0, lo_open=True),
    "rope_theta": Range(1.0, 1e12),
    "sliding_partial_rotary_factor": Range(0.0, 1.0, lo_open=True),
    "sliding_rope_theta": Range(1.0, 1e12),
    "rms_norm_eps": Range(1e-12, 1.0),
    "initializer_range": Range(0.0, 1.0, lo_open=True),
    "temp_init": Range(-100.0, 100.0),
}


@dataclass
class ZayaConfig:
    """Shape of a ZAYA1-style model (native 40-block form: one CCGQA attention + one MoE sublayer per block)."""

    vocab_size: int  # token ids 0 .. vocab_size - 1; rows of the tied embedding
    hidden_size: int  # D, the width of the residual stream
    num_hidden_layers: int  # blocks; the legacy checkpoint layout has twice as many "layers"
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads, each shared by a group of query heads
    head_dim: int  # width of one attention head
    num_experts: int  # routed experts; the router emits one more logit for the skip route
    moe_intermediate_size: int  # F, the width of one SwiGLU expert
    router_hidden_size: int  # R, the width of the router's down-projection and MLP
    cca_time0: int = 2  # kernel of the depthwise convolution
    cca_time1: int = 2  # kernel of the per-head grouped convolution
    partial_rotary_factor: float = 0.5  # share of head_dim that RoPE rotates (in `hybrid` blocks)
    rope_theta: float = 10_000.0  # RoPE base (of `hybrid` blocks; a context-extension phase raises it)
    # Each block's type, "hybrid" or "hybrid_sliding", one entry per block; unset: every block "hybrid". A
    # "hybrid_sliding" block attends to the last `sliding_window` positions only (key s seen by query t iff
    # t - W < s <= t) and rotates by its own RoPE parameters (sliding_rope_theta, sliding_partial_rotary_factor).
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # W, the positions a `hybrid_sliding` block sees (itself included)
    sliding_partial_rotary_factor: float = 0.5  # share of head_dim that RoPE rotates in `hybrid_sliding` blocks
    sliding_rope_theta: float = 10_000.0  # RoPE base of `hybrid_sliding` blocks
    max_position_embeddings: int = 4096  # the longest sequence the model is meant for (exported with it)
    rms_norm_eps: float = 1e-5  # epsilon of every RMSNorm
    initializer_range: float = 0.02  # standard deviation of the matrices' normal initialisation
    # Key temperature at init. The public code's 0 zeroes every key at step 0 (spec section 8), and the query, key
    # and convolution weights learn nothing until it moves: 40-step runs of three small shapes ended 0.4-1.05
    # lower in held-out loss at 1 (docs/model.md). Weights loaded from elsewhere carry their own temperature.
    temp_init: float = 1.0
    # What the skip (MoD) route outputs: "zero" as in the HF-native code, "identity" (gate * x) as in the
    # legacy ZAYA1-base code. Practically moot while its balancing bias is -1 (spec section 5.1).
    skip_route: SkipRoute = "zero"
    # Compute the tied LM head in fp32 (`zaya_high_prec` of the public configs).
    fp32_logits: bool = True
    pad_token_id: int = 0  # id of the padding token
    bos_token_id: int = 2  # id of the beginning-of-sequence token
    eos_token_id: int = 1  # id of the end-of-sequence token

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived shapes -------------------------------------------------------------------------------

    @property
    def query_latent(self) -> int:
        """Width of all query heads together (1024 for ZAYA1: half of d_model)."""
        return self.num_attention_heads * self.head_dim

    @property
    def key_latent(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the packed [queries | keys] vector that the two convolutions mix."""
        return self.query_latent + self.key_latent

    @property
    def conv_padding(self) -> int:
        """Total causal left padding of the two convolutions (2 for ZAYA1's kernels of 2)."""
        return (self.cca_time0 - 1) + (self.cca_time1 - 1)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sliding_rotary_dim(self) -> int:
        return int(self.head_dim * self.sliding_partial_rotary_factor)

    def layer_type(self, block: int) -> str:
        """The type of block `block`: "hybrid" or "hybrid_sliding"."""
        return "hybrid" if self.layer_types is None else self.layer_types[block]

    def window(self, block: int) -> int | None:
        """The positions block `block` attends to: `sliding_window` for a sliding block, None (all) otherwise."""
        return self.sliding_window if self.layer_type(block) == "hybrid_sliding" else None

    @property
    def active_window(self) -> int | None:
        """The window of the sliding blocks; None where no block slides (a `sliding_window` then goes unused)."""
        return self.sliding_window if self.sliding_blocks else None

    @property
    def sliding_blocks(self) -> int:
        """How many blocks attend through a sliding window."""
        return 0 if self.layer_types is None else self.layer_types.count("hybrid_sliding")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_cache_values_per_token(self) -> int:
        """Values stored per token per layer in the decode cache (keys + values): 2 * n_k * head_dim."""
        return 2 * self.key_latent

    # ---- validation and (de)serialisation -------------------------------------------------------------

    def validate(self, source: str = "model config") -> None:
        """Raise `ZayaError` naming the first field whose value cannot describe a ZAYA model."""
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "moe_intermediate_size", "router_hidden_size", "cca_time0", "cca_time1",
            "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ZayaError(f"{source}: field '{name}' must be a positive integer, got {shown(value)}")
            if value > SIZE_LIMITS[name]:
                said = f"{value:,}" if value < 10**30 else shown(value)
                raise ZayaError(f"{source}: field '{name}' = {said} is above the bound {SIZE_LIMITS[name]:,}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ZayaError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.key_latent % 2:
            raise ZayaError(f"{source}: num_key_value_heads * head_dim must be even (the value shift splits it in two)")
        for name, bounds in FLOAT_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ZayaError(f"{source}: field '{name}' must be a finite number, got {shown(value)}")
            if not bounds.holds(value):
                raise ZayaError(f"{source}: field '{name}' must be in {bounds.text(integer=False)}, got {shown(value)}")
        for name in ("partial_rotary_factor", "sliding_partial_rotary_factor"):
            factor = getattr(self, name)
            rotary = int(self.head_dim * factor)
            if self.head_dim * factor != rotary or rotary % 2:
                raise ZayaError(f"{source}: head_dim * {name} must be an even integer, got {self.head_dim} * {factor}")
        self._validate_layer_types(source)
        if not isinstance(self.fp32_logits, bool):
            raise ZayaError(f"{source}: field 'fp32_logits' must be true or false, got {shown(self.fp32_logits)}")
        if not isinstance(self.skip_route, str) or self.skip_route not in ("zero", "identity"):
            raise ZayaError(f"{source}: field 'skip_route' must be 'zero' or 'identity', got {shown(self.skip_route)}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not (0 <= value < self.vocab_size):
                raise ZayaError(f"{source}: field '{name}' must be a token id below vocab_size, got {shown(value)}")

    def _validate_layer_types(self, source: str) -> None:
        types, window = self.layer_types, self.sliding_window
        if types is not None:
            if not isinstance(types, (list, tuple)):
                raise ZayaError(f"{source}: field 'layer_types' must be a list of block types, got {shown(types)}")
            if len(types) != self.num_hidden_layers:
                raise ZayaError(f"{source}: field 'layer_types' has {len(types)} entries for num_hidden_layers = "
                                f"{self.num_hidden_layers}: one per block")
            for i, kind in enumerate(types):
                if kind not in LAYER_TYPES:
                    raise ZayaError(f"{source}: layer_types[{i}] is {shown(kind)}: a block is "
                                    f"{' or '.join(repr(t) for t in LAYER_TYPES)}")
            self.layer_types = list(types)
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ZayaError(f"{source}: field 'sliding_window' must be a positive integer (the positions a "
                                f"sliding block sees), got {shown(window)}")
            if window > SIZE_LIMITS["sliding_window"]:
                raise ZayaError(f"{source}: field 'sliding_window' = {window:,} is above the bound "
                                f"{SIZE_LIMITS['sliding_window']:,}")
        if self.sliding_blocks and window is None:
            raise ZayaError(f"{source}: field 'sliding_window' must be set when layer_types has 'hybrid_sliding' "
                            "blocks")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "model config") -> ZayaConfig:
        """Build from a dict, refusing unknown fields and wrong types with a message naming `source`."""
        if not isinstance(data, dict):
            raise ZayaError(f"{source}: expected a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ZayaError(f"{source}: unknown field '{unknown[0]}'")
        missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ZayaError(f"{source}: missing field '{missing[0]}'")
        clean = {}
        for name, value in data.items():
            default = fields[name].default
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            clean[name] = value
        config = cls.__new__(cls)
        for name, f in fields.items():
            setattr(config, name, clean.get(name, f.default))
        config.validate(source)
        return config

    def replace(self, **changes: Any) -> ZayaConfig:
        return dataclasses.replace(self, **changes)
