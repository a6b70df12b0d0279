"""Model helpers shared by tests, importable from spawned processes too (a conftest is not, reliably: each
test directory has its own)."""

from __future__ import annotations

import torch

from zaya.model.config import ZayaConfig


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add noise to every parameter, so residual scales, biases, EDA gammas and temperatures all matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def legacy_config_json(config: ZayaConfig) -> dict:
    """A ZAYA1-base style (Megatron, 80-layer) config.json for `config`."""
    n = config.num_hidden_layers
    return {
        "architectures": ["ZayaForCausalLM"], "model_type": "zaya", "hidden_size": config.hidden_size,
        "num_hidden_layers": 2 * n, "zaya_layers": ["a", config.num_experts] * n,
        "num_attention_heads": 2 * config.num_attention_heads, "cca_num_q_heads": [config.num_attention_heads, 0] * n,
        "num_query_groups_list": [config.num_key_value_heads, 0] * n, "num_key_value_heads": 2,
        "kv_channels": config.head_dim, "ffn_hidden_size_list": [0, 2 * config.moe_intermediate_size] * n,
        "zaya_mlp_expansion": [0, config.router_hidden_size] * n, "vocab_size": config.vocab_size,
        "partial_rotary_factor": config.partial_rotary_factor, "rope_theta": config.rope_theta,
        "norm_epsilon": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "cca_time0": config.cca_time0, "cca_time1": config.cca_time1, "activation_func": "swiglu",
        "moe_router_topk": 1, "zaya_use_mod": True, "zaya_use_eda": True, "zaya_high_prec": True,
        "residual_in_fp32": True, "scale_residual_merge": True, "clamp_temp": False, "bos_token_id": 2,
        "eos_token_id": 1, "pad_token_id": 0,
    }


def random_attention_inputs(B: int, Hq: int, Hk: int, T: int, d: int, seed: int = 5):
    """q [B, Hq, T, d], k and v [B, Hk, T, d] and an output gradient like q, drawn in that order from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, d, generator=generator)
    k, v = (torch.randn(B, Hk, T, d, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(B, Hq, T, d, generator=generator)


def dense_attention(q, k, v, grad_out, first, window):
    """The reference the attention kernels are held to: softmax attention of q [B, Hq, T, d] over k, v
    [B, Hk, T, d] with the [T, T] mask of `zaya.model.masks.allowed` (documents starting at `first` [B, T],
    causal, within `window`), formed densely, and its backward of `grad_out`. Returns (output, [q, k, v] copies
    holding their gradients)."""
    import math

    from zaya.model.masks import allowed

    B, Hq, T, d = q.shape
    Hk = k.shape[1]
    mask = torch.stack([allowed(0, T, 0, T, first[b], window) for b in range(B)])[:, None, None]  # [B, 1, 1, T, T]
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qkv[0].view(B, Hk, Hq // Hk, T, d), qkv[1]) / math.sqrt(d)
    out = torch.einsum("bhgqk,bhkd->bhgqd", scores.masked_fill(~mask, -math.inf).softmax(-1), qkv[2])
    out = out.reshape(B, Hq, T, d)
    out.backward(grad_out)
    return out, qkv
