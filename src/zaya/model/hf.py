"""Hugging Face interop: the key maps of the native (40-block) and legacy (80-layer) layouts, config.json in
both schemas, and reading/writing safetensors directories, single-file or sharded (spec section 7;
the files themselves: `zaya.model.safetensors_files`).

Our parameter names are our own (`blocks.3.attn.q_proj.weight`); `native_key(name)` and `legacy_keys(name)`
give the checkpoint keys, and the loaders check every expected key, every extra key and every shape.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from zaya import reading
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.safetensors_files import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    read_weight_map,
    safetensors_files,
    write_weights,
)
from zaya.schema import is_a, shown

Layout = Literal["native", "legacy"]

# ---- key maps -----------------------------------------------------------------------------------------

_NATIVE_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_scaling.scale": "model.input_hidden_states_scale",
    "embed_scaling.bias": "model.input_hidden_states_bias",
    "norm.weight": "model.norm.weight",
}
_RESIDUAL = {
    "branch_scale": "hidden_states_scale",
    "branch_bias": "hidden_states_bias",
    "stream_scale": "residual_scale",
    "stream_bias": "residual_bias",
}
_NATIVE_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "moe_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.qkv_proj.q_proj.weight",
    "attn.k_proj.weight": "self_attn.qkv_proj.k_proj.weight",
    "attn.v_cur_proj.weight": "self_attn.qkv_proj.v_proj_current.weight",
    "attn.v_del_proj.weight": "self_attn.qkv_proj.v_proj_delayed.weight",
    "attn.conv0_weight": "self_attn.qkv_proj.conv_qk_depthwise.weight",
    "attn.conv0_bias": "self_attn.qkv_proj.conv_qk_depthwise.bias",
    "attn.conv1_weight": "self_attn.qkv_proj.conv_qk_grouped.weight",
    "attn.conv1_bias": "self_attn.qkv_proj.conv_qk_grouped.bias",
    "attn.temp": "self_attn.qk_norm.temp",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "moe.router.down_proj.weight": "mlp.gate.down_proj.weight",
    "moe.router.down_proj.bias": "mlp.gate.down_proj.bias",
    "moe.router.router_states_scale": "mlp.gate.router_states_scale",
    "moe.router.balancing_biases": "mlp.gate.balancing_biases",
    "moe.router.norm.weight": "mlp.gate.router_mlp.norm.weight",
    "moe.router.fc1.weight": "mlp.gate.router_mlp.fc1.weight",
    "moe.router.fc1.bias": "mlp.gate.router_mlp.fc1.bias",
    "moe.router.fc2.weight": "mlp.gate.router_mlp.fc2.weight",
    "moe.router.fc2.bias": "mlp.gate.router_mlp.fc2.bias",
    "moe.router.out_proj.weight": "mlp.gate.router_mlp.out_proj.weight",
    "moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "moe.experts.down_proj": "mlp.experts.down_proj",
    **{f"attn_residual.{ours}": f"post_attention_residual_scale.{hf}" for ours, hf in _RESIDUAL.items()},
    **{f"moe_residual.{ours}": f"post_mlp_residual_scale.{hf}" for ours, hf in _RESIDUAL.items()},
}
# Legacy layer 2L is block L's attention, layer 2L+1 its MoE (spec section 7.1).
_LEGACY_ATTN = {
    "attn_norm.weight": "input_norm.weight",
    "attn.q_proj.weight": "self_attn.qkv.linear_q.weight",
    "attn.k_proj.weight": "self_attn.qkv.linear_k.weight",
    "attn.v_cur_proj.weight": "self_attn.qkv.val_proj1.weight",
    "attn.v_del_proj.weight": "self_attn.qkv.val_proj2.weight",
    "attn.conv0_weight": "self_attn.qkv.conv_qk.0.weight",
    "attn.conv0_bias": "self_attn.qkv.conv_qk.0.bias",
    "attn.conv1_weight": "self_attn.qkv.conv_qk.1.weight",
    "attn.conv1_bias": "self_attn.qkv.conv_qk.1.bias",
    "attn.temp": "self_attn.qkv.temp",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
}
_LEGACY_MOE = {
    "moe_norm.weight": "input_norm.weight",
    "moe.router.down_proj.weight": "zaya_block.router.down_proj.weight",
    "moe.router.down_proj.bias": "zaya_block.router.down_proj.bias",
    "moe.router.router_states_scale": "zaya_block.router.router_states_scale",
    "moe.router.balancing_biases": "zaya_block.router.balancing_biases",
    "moe.router.norm.weight": "zaya_block.router.rmsnorm_eda.weight",
    "moe.router.fc1.weight": "zaya_block.router.router_mlp.0.weight",
    "moe.router.fc1.bias": "zaya_block.router.router_mlp.0.bias",
    "moe.router.fc2.weight": "zaya_block.router.router_mlp.2.weight",
    "moe.router.fc2.bias": "zaya_block.router.router_mlp.2.bias",
    "moe.router.out_proj.weight": "zaya_block.router.router_mlp.4.weight",
    **{f"attn_residual.{ours}": f"res_scale.{hf}" for ours, hf in _RESIDUAL.items()},
}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def native_key(name: str) -> str:
    """The HF-native checkpoint key of our parameter or buffer `name`."""
    if name in _NATIVE_TOP:
        return _NATIVE_TOP[name]
    match = _BLOCK_KEY.fullmatch(name)
    if match and match.group(2) in _NATIVE_BLOCK:
        return f"model.layers.{match.group(1)}.{_NATIVE_BLOCK[match.group(2)]}"
    raise KeyError(name)


def legacy_keys(name: str, num_blocks: int, num_experts: int) -> list[str]:
    """The legacy (80-layer) checkpoint keys holding our `name`; stacked experts map to one key per expert."""
    if name == "embed.weight":
        return ["model.embed_tokens.weight"]
    if name == "embed_scaling.scale":
        return ["model.layers.0.res_scale.hidden_states_scale"]
    if name == "embed_scaling.bias":
        return ["model.layers.0.res_scale.hidden_states_bias"]
    if name == "norm.weight":
        return ["model.final_norm.weight"]
    match = _BLOCK_KEY.fullmatch(name)
    if not match:
        raise KeyError(name)
    block, rest = int(match.group(1)), match.group(2)
    if rest in _LEGACY_ATTN:
        return [f"model.layers.{2 * block}.{_LEGACY_ATTN[rest]}"]
    if rest in _LEGACY_MOE:
        return [f"model.layers.{2 * block + 1}.{_LEGACY_MOE[rest]}"]
    if rest.startswith("moe_residual."):
        field = _RESIDUAL[rest.split(".", 1)[1]]
        # the merge after block L's MoE happens at the start of legacy layer 2L+2, or at the model's end
        prefix = "model" if block == num_blocks - 1 else f"model.layers.{2 * block + 2}"
        return [f"{prefix}.res_scale.{field}"]
    experts = f"model.layers.{2 * block + 1}.zaya_block.experts.local_experts"
    if rest == "moe.experts.gate_up_proj":
        return [f"{experts}.{e}.linear_fc1.weight" for e in range(num_experts)]
    if rest == "moe.experts.down_proj":
        return [f"{experts}.{e}.linear_fc2.weight" for e in range(num_experts)]
    raise KeyError(name)


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


# ---- safetensors --------------------------------------------------------------------------------------


class TensorSource:
    """Lazy access to every tensor of an HF directory, remembering which file holds which key."""

    def __init__(self, directory: Path):
        self.location: dict[str, Path] = {}
        self._handles = {}
        directory = Path(directory)
        for file in safetensors_files(directory):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise ZayaError(f"{file}: not a readable safetensors file ({exc})") from None
            self._handles[file] = handle
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                self.location[key] = file
        # a stale index (a shard rewritten, a tensor moved) would otherwise load whichever copy is read last
        for key, name in (read_weight_map(directory) or {}).items():
            if self.location.get(key) != directory / name:
                raise ZayaError(f"{directory / INDEX_FILE}: tensor '{key}' is not in {name}, as the index says")

    def keys(self) -> set[str]:
        return set(self.location)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.location[key]].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handles[self.location[key]].get_tensor(key)
        except Exception as exc:
            raise ZayaError(f"{self.location[key]}: cannot read tensor '{key}' ({exc})") from None

    def file_of(self, key: str) -> Path:
        return self.location[key]

    def dtype(self) -> torch.dtype:
        """The dtype of the embedding, the checkpoint's working dtype (fp32 for a directory of no tensors at all,
        which the loader then refuses naming what is missing)."""
        if not self.location:
            return torch.float32
        key = "model.embed_tokens.weight" if "model.embed_tokens.weight" in self.location else next(iter(self.location))
        name = self._handles[self.location[key]].get_slice(key).get_dtype()
        return _SAFETENSORS_DTYPES.get(name, torch.float32)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def load_hf_state(
    directory: Path, config: ZayaConfig, expected: dict[str, torch.Size], layout: Layout
) -> dict[str, torch.Tensor]:
    """Read an HF directory into our parameter names, checking missing, extra and misshaped tensors.

    `expected` maps each of our names (parameters and persistent buffers) to its shape.
    """
    source = TensorSource(directory)
    present = source.keys()
    wanted: dict[str, list[str]] = {}
    for name in expected:
        wanted[name] = (
            [native_key(name)] if layout == "native"
            else legacy_keys(name, config.num_hidden_layers, config.num_experts)
        )
    all_wanted = {key for keys in wanted.values() for key in keys}
    # A tied LM head may be written out; it is the embedding, so it is accepted and not read.
    extra = sorted(present - all_wanted - {"lm_head.weight"})
    if extra:
        raise ZayaError(f"{source.file_of(extra[0])}: unexpected tensor '{extra[0]}' ({len(extra)} unexpected in all)")
    missing = sorted(all_wanted - present)
    if missing:
        raise ZayaError(f"{directory}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    state = {}
    for name, keys in wanted.items():
        shape = tuple(expected[name])
        per_key_shape = shape[1:] if len(keys) > 1 else shape
        for key in keys:
            if source.shape(key) != per_key_shape:
                raise ZayaError(
                    f"{source.file_of(key)}: tensor '{key}' has shape {list(source.shape(key))}, "
                    f"expected {list(per_key_shape)}"
                )
        tensors = [source.get(key) for key in keys]
        state[name] = torch.stack(tensors) if len(keys) > 1 else tensors[0]
    return state


def save_hf_state(
    directory: Path, state: dict[str, torch.Tensor], config: ZayaConfig, layout: Layout = "native", *,
    dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write our state dict as HF safetensors in the given layout, every tensor in `dtype` (None: each its
    own): `model.safetensors`, or above `max_shard_bytes` shards with `model.safetensors.index.json`. Returns
    the files written; config.json is the caller's."""
    tensors = {}
    for name, tensor in state.items():
        if layout == "native":
            tensors[native_key(name)] = tensor.detach()
        else:
            keys = legacy_keys(name, config.num_hidden_layers, config.num_experts)
            parts = tensor.detach().unbind(0) if len(keys) > 1 else [tensor.detach()]
            tensors.update(zip(keys, parts, strict=True))
    return write_weights(Path(directory), tensors, dtype, max_shard_bytes)
