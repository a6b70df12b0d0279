"""Hugging Face interop: the key maps of the native (40-block) and legacy (80-layer) layouts, and reading/writing
safetensors directories, single-file or sharded (spec section 7; the files themselves:
`zaya.model.safetensors_files`; config.json in both schemas: `zaya.model.hf_config`).

Our parameter names are our own (`blocks.3.attn.q_proj.weight`); `native_key(name)` and `legacy_keys(name)`
give the checkpoint keys, and the loaders check every expected key, every extra key and every shape.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.hf_config import Layout
from zaya.model.safetensors_files import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    read_weight_map,
    safetensors_files,
    write_weights,
)

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
