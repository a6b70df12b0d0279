"""Hugging Face `config.json` in both schemas (spec section 7): the native one transformers' `ZayaConfig` reads
(ZAYA1-8B; `layer_types`, `sliding_window` and `rope_parameters` per block type), read and written, and the
legacy Megatron-style one of ZAYA1-base (80 layers), read. A config transformers accepts, this reads to the same
model; one it cannot run is one line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from zaya import reading
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.schema import is_a, shown

Layout = Literal["native", "legacy"]

# ---- config.json --------------------------------------------------------------------------------------

# HF ZayaConfig defaults, used where a native config.json leaves a field out (what transformers would do).
_NATIVE_DEFAULTS = dict(
    head_dim=128, num_experts=16, moe_intermediate_size=2048, router_hidden_size=256, cca_time0=2, cca_time1=2,
    rms_norm_eps=1e-5, max_position_embeddings=131_072, initializer_range=0.02, pad_token_id=0, bos_token_id=2,
    eos_token_id=106,
)
_NATIVE_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def read_config_json(path: Path) -> dict:
    """`path` as a JSON object, read as any input (`zaya.reading`: a regular file of at most 4 MiB, nested at most
    64 deep), with one-line errors for a missing, malformed or unreadable file."""
    return reading.read_json_object(path, "config", "a model's config.json")


def detect_layout(data: dict) -> Layout:
    """Legacy configs carry per-layer lists (`zaya_layers`, ...) or Megatron fields; native ones do not."""
    legacy_markers = ("zaya_layers", "ffn_hidden_size", "ffn_hidden_size_list", "activation_func", "cca_num_q_heads")
    return "legacy" if any(key in data for key in legacy_markers) else "native"


def _get_int(data: dict, key: str, source: Path, default=None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ZayaError(f"{source}: missing field '{key}'")
    if not is_a(value, int):
        raise ZayaError(f"{source}: field '{key}' must be an integer within +-2**63, got {shown(value)}")
    return value


def _get_str(data: dict, key: str, source: Path, default: str, prefix: str = "") -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise ZayaError(f"{source}: field '{prefix}{key}' must be a string, got {shown(value)}")
    return value


def _get_bool(data: dict, key: str, source: Path, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ZayaError(f"{source}: field '{key}' must be true or false, got {shown(value)}")
    return value


def _get_float(data: dict, key: str, source: Path, default: float | None, prefix: str = "") -> float:
    value = data.get(key, default)
    if not is_a(value, (int, float)):
        raise ZayaError(f"{source}: field '{prefix}{key}' must be a finite number, got {shown(value)}")
    return float(value)


def _token_id(data: dict, key: str, source: Path, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, list) and value:
        value = value[0]
    if value is None:
        return default
    if not is_a(value, int):
        raise ZayaError(f"{source}: field '{key}' must be a token id, got {shown(value)}")
    return value


def config_from_native(data: dict, source: Path) -> ZayaConfig:
    """ZayaConfig from an HF-native `config.json` (ZAYA1-8B schema)."""
    if data.get("model_type", "zaya") != "zaya":
        raise ZayaError(f"{source}: model_type is {shown(data.get('model_type'))}, expected 'zaya'")
    for key in _NATIVE_REQUIRED:
        _get_int(data, key, source)
    if data.get("num_experts_per_tok", 1) != 1:
        raise ZayaError(f"{source}: num_experts_per_tok must be 1 (ZAYA routes each token to one expert)")
    layer_types = data.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ZayaError(f"{source}: field 'layer_types' must be a list of block types, got {shown(layer_types)}")
    rope = _rope_parameters(data, source, set(layer_types or ["hybrid"]))
    extra = data.get("zaya_stack", {})
    if not isinstance(extra, dict):
        raise ZayaError(f"{source}: field 'zaya_stack' must be an object")
    fields = {key: _get_int(data, key, source, _NATIVE_DEFAULTS.get(key)) for key in (
        *_NATIVE_REQUIRED, "head_dim", "num_experts", "moe_intermediate_size", "router_hidden_size", "cca_time0",
        "cca_time1", "max_position_embeddings")}
    config = dict(
        fields,
        rms_norm_eps=_get_float(data, "rms_norm_eps", source, _NATIVE_DEFAULTS["rms_norm_eps"]),
        initializer_range=_get_float(data, "initializer_range", source, _NATIVE_DEFAULTS["initializer_range"]),
        rope_theta=rope["hybrid"][0],
        partial_rotary_factor=rope["hybrid"][1],
        layer_types=layer_types,
        sliding_window=data.get("sliding_window"),
        sliding_rope_theta=rope["hybrid_sliding"][0],
        sliding_partial_rotary_factor=rope["hybrid_sliding"][1],
        pad_token_id=_token_id(data, "pad_token_id", source, 0),
        bos_token_id=_token_id(data, "bos_token_id", source, 2),
        eos_token_id=_token_id(data, "eos_token_id", source, 106),
        skip_route=_get_str(extra, "skip_route", source, "zero", "zaya_stack."),
        temp_init=_get_float(extra, "temp_init", source, 0.0),
        fp32_logits=_get_bool(extra, "fp32_logits", source, True),
    )
    try:
        return ZayaConfig.from_dict(config, source=str(source))
    except TypeError as exc:
        raise ZayaError(f"{source}: {exc}") from None


# transformers' RoPE parameters of a ZAYA config without `rope_parameters`: (rope_theta, partial_rotary_factor)
_DEFAULT_ROPE = {"hybrid": (5_000_000.0, 0.5), "hybrid_sliding": (10_000.0, 0.5)}


def _rope_parameters(data: dict, source: Path, used: set[str]) -> dict[str, tuple[float, float]]:
    """(rope_theta, partial_rotary_factor) per block type from `rope_parameters`, as transformers reads them:
    nested per type (a stray top-level `rope_type` beside the types, as hub configs carry, is ignored), an entry
    for each type the blocks use, `partial_rotary_factor` 1.0 where an entry leaves it out, and only the
    'default' RoPE. The flat form (one set, no types) is read for models whose blocks are all `hybrid`."""
    rope = data.get("rope_parameters")
    if rope is None:
        return dict(_DEFAULT_ROPE)
    if not isinstance(rope, dict):
        raise ZayaError(f"{source}: field 'rope_parameters' must be an object, got {shown(rope)}")
    if not any(kind in rope for kind in _DEFAULT_ROPE):  # flat: the `hybrid` blocks'
        if "hybrid_sliding" in used:
            raise ZayaError(f"{source}: rope_parameters has no 'hybrid_sliding' entry, and layer_types has "
                            "'hybrid_sliding' blocks")
        _rope_type(rope, source, "rope_parameters")
        theta = _get_float(rope, "rope_theta", source, data.get("rope_theta", 5_000_000.0))
        factor = _get_float(rope, "partial_rotary_factor", source, data.get("partial_rotary_factor", 0.5))
        return {"hybrid": (theta, factor), "hybrid_sliding": _DEFAULT_ROPE["hybrid_sliding"]}
    out = {}
    for kind, default in _DEFAULT_ROPE.items():
        entry = rope.get(kind)
        if entry is None:
            if kind in used:
                raise ZayaError(f"{source}: rope_parameters has no '{kind}' entry, and layer_types has '{kind}' "
                                "blocks")
            out[kind] = default
            continue
        where = f"rope_parameters.{kind}"
        if not isinstance(entry, dict):
            raise ZayaError(f"{source}: field '{where}' must be an object, got {shown(entry)}")
        _rope_type(entry, source, where)
        if "rope_theta" not in entry:
            raise ZayaError(f"{source}: missing field '{where}.rope_theta'")
        out[kind] = (_get_float(entry, "rope_theta", source, None, where + "."),
                     _get_float(entry, "partial_rotary_factor", source, 1.0, where + "."))
    return out


def _rope_type(entry: dict, source: Path, where: str) -> None:
    kind = entry.get("rope_type", "default")
    if kind != "default":
        raise ZayaError(f"{source}: {where}.rope_type {shown(kind)} is not supported: zaya applies the 'default' "
                        "RoPE only")


def _first_nonzero(data: dict, key: str, source: Path) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, list):
        value = next((v for v in value if v != 0), None)
        if value is None:
            raise ZayaError(f"{source}: field '{key}' has no non-zero entry")
    if not is_a(value, int):
        raise ZayaError(f"{source}: field '{key}' must be an integer or a list of integers")
    return value


def config_from_legacy(data: dict, source: Path) -> ZayaConfig:
    """ZayaConfig from a legacy (ZAYA1-base, Megatron-style, 80-layer) `config.json`."""
    hidden = _get_int(data, "hidden_size", source)
    layers = data.get("zaya_layers")
    if layers is not None:
        if not isinstance(layers, list) or not layers or len(layers) % 2 or any(
            (n % 2 == 0) != (kind == "a") for n, kind in enumerate(layers)
        ):
            raise ZayaError(f"{source}: field 'zaya_layers' must alternate 'a' (attention) and an expert count")
        counts = layers[1::2]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts) or len(set(counts)) != 1:
            raise ZayaError(f"{source}: field 'zaya_layers' must give every MoE layer the same expert count")
        num_blocks, num_experts = len(layers) // 2, counts[0]
    else:
        total = _get_int(data, "num_hidden_layers", source)
        if total % 2:
            raise ZayaError(f"{source}: num_hidden_layers must be even in the legacy layout, got {total}")
        num_blocks, num_experts = total // 2, _get_int(data, "num_experts", source, 16)
    q_heads = _first_nonzero(data, "cca_num_q_heads", source) or _get_int(data, "num_attention_heads", source)
    kv_heads = (
        _first_nonzero(data, "num_query_groups_list", source)
        or (_get_int(data, "num_query_groups", source) if data.get("num_query_groups") else None)
        or _get_int(data, "num_key_value_heads", source)
    )
    head_key = "kv_channels" if data.get("kv_channels") else "head_dim"
    head_dim = _get_int(data, head_key, source) if data.get(head_key) is not None else None
    if head_dim is None:
        # The fork derives the head width from num_attention_heads, which it keeps at twice the q heads.
        heads = _get_int(data, "num_attention_heads", source)
        if heads < 1:
            raise ZayaError(f"{source}: field 'num_attention_heads' must be a positive integer, got {heads}")
        head_dim = hidden // heads
    ffn = _first_nonzero(data, "ffn_hidden_size_list", source) or _get_int(data, "ffn_hidden_size", source, 4096)
    if ffn < 2:
        raise ZayaError(f"{source}: the expert fc1 width (ffn_hidden_size) must be a positive even integer, got {ffn}")
    if ffn % 2:
        raise ZayaError(f"{source}: the expert fc1 width (ffn_hidden_size) must be even (gate and up halves)")
    router = _first_nonzero(data, "zaya_mlp_expansion", source) or 256
    if data.get("moe_router_topk", 1) != 1:
        raise ZayaError(f"{source}: moe_router_topk must be 1 (ZAYA routes each token to one expert)")
    if data.get("clamp_temp", False):
        raise ZayaError(f"{source}: clamp_temp=true models are not supported (ZAYA1 uses a direct temperature)")
    config = dict(
        vocab_size=_get_int(data, "vocab_size", source),
        hidden_size=hidden,
        num_hidden_layers=num_blocks,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        moe_intermediate_size=ffn // 2,
        router_hidden_size=router,
        cca_time0=_get_int(data, "cca_time0", source, 2),
        cca_time1=_get_int(data, "cca_time1", source, 2),
        partial_rotary_factor=_get_float(data, "partial_rotary_factor", source, 0.5),
        rope_theta=_get_float(data, "rope_theta", source, 1_000_000.0),
        max_position_embeddings=_get_int(data, "max_position_embeddings", source, 32_768),
        rms_norm_eps=_get_float(data, "norm_epsilon", source, 1e-5),
        pad_token_id=_token_id(data, "pad_token_id", source, 0),
        bos_token_id=_token_id(data, "bos_token_id", source, 2),
        eos_token_id=_token_id(data, "eos_token_id", source, 1),
        skip_route="identity",
        fp32_logits=_get_bool(data, "zaya_high_prec", source, True),
    )
    return ZayaConfig.from_dict(config, source=str(source))


def native_config_json(config: ZayaConfig, dtype: torch.dtype) -> dict:
    """The HF-native `config.json` for `config` (loads with `AutoModelForCausalLM.from_pretrained`); `dtype` is
    the one every tensor of the export is stored in, the fp32 balancing biases included, since transformers
    loads a model in its config's dtype."""
    return {
        "architectures": ["ZayaForCausalLM"],
        "model_type": "zaya",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types or ["hybrid"] * config.num_hidden_layers),
        "sliding_window": config.sliding_window,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_experts": config.num_experts,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": config.moe_intermediate_size,
        "router_hidden_size": config.router_hidden_size,
        "cca_time0": config.cca_time0,
        "cca_time1": config.cca_time1,
        "hidden_act": "silu",
        "attention_bias": False,
        "lm_head_bias": False,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rope_parameters": {
            "hybrid": {
                "rope_type": "default",
                "rope_theta": config.rope_theta,
                "partial_rotary_factor": config.partial_rotary_factor,
            },
            "hybrid_sliding": {
                "rope_type": "default",
                "rope_theta": config.sliding_rope_theta,
                "partial_rotary_factor": config.sliding_partial_rotary_factor,
            },
        },
        "tie_word_embeddings": True,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "dtype": str(dtype).removeprefix("torch."),
        # Fields of ours that the HF schema has no place for; transformers keeps them as plain attributes.
        "zaya_stack": {
            "skip_route": config.skip_route,
            "temp_init": config.temp_init,
            "fp32_logits": config.fp32_logits,
        },
    }
