"""The GEMMs a model runs, and the ones a sweep (`zaya shapes`, `shapes.py`) measures around a preset.

The GEMMs of one layer for a micro-batch of N tokens (D hidden, Q = heads * head_dim, K = kv_heads * head_dim,
F expert width, E experts, R router width, V vocabulary), named as in `GemmShape.kind`:

    attn_in         [N, D] x [D, Q + 2K]      W_q, W_k, W_vcur, W_vdel as one matmul
    attn_out        [N, Q] x [Q, D]
    router_down     [N, D] x [D, R]           the router runs in fp32 whatever the model's dtype
    router_mlp      [N, R] x [R, R]           twice (fc1, fc2)
    router_out      [N, R] x [R, E + 1]
    expert_gate_up  E groups of [N/E, D] x [D, 2F]    one grouped matmul (`torch._grouped_mm`), balanced
    expert_down     E groups of [N/E, F] x [F, D]
    attention       causal softmax attention, forward + backward (`F.scaled_dot_product_attention`, GQA)

and once per model the tied LM head with its fused loss, which forms the gradients in its forward pass:
lm_head [N, D] x [D, V], lm_grad_hidden [N, V] x [V, D] and lm_grad_weight [V, N] x [N, D] (in fp32 with
`fp32_logits`, the presets' default).

A sweep varies the hidden size, the expert width and the head dim one at a time, over values around the
preset's (`variant_values`); `plan_sweep` puts the most telling shapes first, for when its time runs out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from zaya.plan.table import gemm_flops


@dataclass(frozen=True)
class GemmShape:
    """One GEMM a model runs. dense: [m, k] x [k, n]; grouped: m rows over `groups` groups, each
    [m / groups, k] x [k, n]; attention: m = seq len T, n = head_dim, k = query heads, groups = kv heads."""

    kind: str
    op: str
    m: int
    n: int
    k: int
    groups: int = 1
    fp32: bool = False  # runs in fp32 whatever the model's dtype (router; LM head with fp32_logits)
    count: int = 1  # calls per forward pass of the whole model
    layout: str = "nt"  # dense: "nt" x @ w^T (nn.Linear), "nn" a @ b, "tn" a^T @ b
    batch: int = 1  # attention: sequences per call

    @property
    def flops(self) -> float:
        return gemm_flops(self.op, self.m, self.n, self.k, self.groups, self.batch)

    def dtype(self, model_dtype: str) -> str:
        return "fp32" if self.fp32 else model_dtype


@dataclass(frozen=True)
class ModelDims:
    """The dimensions the GEMMs depend on (a sweep varies them freely, past what a config would validate)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    router_hidden_size: int
    vocab_size: int
    num_hidden_layers: int = 1
    fp32_logits: bool = True

    @classmethod
    def from_config(cls, config) -> ModelDims:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes) -> ModelDims:
        return dataclasses.replace(self, **changes)


def model_gemms(model, tokens: int) -> list[GemmShape]:
    """The GEMMs of one forward pass of a model (a `ZayaConfig` or `ModelDims`) over a micro-batch of
    `tokens` tokens, attention excluded (`attention_shape`); `count` says how many of each the model runs.
    Backward passes run the dense and grouped GEMMs twice more, with the shapes' dimensions permuted."""
    d = model if isinstance(model, ModelDims) else ModelDims.from_config(model)
    N, D, L = tokens, d.hidden_size, d.num_hidden_layers
    Q, K = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    R, E, Fw, V = d.router_hidden_size, d.num_experts, d.moe_intermediate_size, d.vocab_size
    logits32 = d.fp32_logits
    return [
        GemmShape("attn_in", "dense", N, Q + 2 * K, D, count=L),
        GemmShape("attn_out", "dense", N, D, Q, count=L),
        GemmShape("router_down", "dense", N, R, D, fp32=True, count=L),
        GemmShape("router_mlp", "dense", N, R, R, fp32=True, count=2 * L),
        GemmShape("router_out", "dense", N, E + 1, R, fp32=True, count=L),
        GemmShape("expert_gate_up", "grouped", N, 2 * Fw, D, groups=E, count=L),
        GemmShape("expert_down", "grouped", N, D, Fw, groups=E, count=L),
        GemmShape("lm_head", "dense", N, V, D, fp32=logits32),
        GemmShape("lm_grad_hidden", "dense", N, D, V, fp32=logits32, layout="nn"),
        GemmShape("lm_grad_weight", "dense", V, D, N, fp32=logits32, layout="tn"),
    ]


def attention_shape(model, seq_len: int, batch: int = 1) -> GemmShape:
    """Causal attention over `batch` sequences of `seq_len` tokens, forward + backward, per layer."""
    d = model if isinstance(model, ModelDims) else ModelDims.from_config(model)
    return GemmShape("attention", "attention", seq_len, d.head_dim, d.num_attention_heads,
                     groups=d.num_key_value_heads, count=d.num_hidden_layers, batch=batch)


# ---- the sweep's shapes ---------------------------------------------------------------------------------


def variant_values(value: int, multiple: int = 8) -> list[int]:
    """The values of one dimension a sweep measures, most informative first: the preset's, misaligned
    neighbours (+1, +8, -8, +16, +32) and multiples x0.5 ... x2 rounded to `multiple`."""
    def scaled(f: float) -> int:
        return max(multiple, round(value * f / multiple) * multiple)

    order = [value, value + 1, value + 8, scaled(0.5), scaled(2.0), value - 8, scaled(0.75), scaled(1.25),
             scaled(1.5), value + 16, value + 32]
    seen: list[int] = []
    for v in order:
        if v > 0 and v not in seen:
            seen.append(v)
    return seen


DIM_FIELDS = {"hidden_size": "hidden_size", "moe_intermediate_size": "moe_intermediate_size",
              "head_dim": "head_dim"}


@dataclass
class _Plan:
    """The shapes of a sweep in the order they are measured, each once."""

    entries: list[tuple[GemmShape, str]] = field(default_factory=list)
    _seen: set = field(default_factory=set)

    def add(self, shapes: Iterable[GemmShape], dtype: str) -> None:
        for shape in shapes:
            key = (shape.op, shape.m, shape.n, shape.k, shape.groups, shape.dtype(dtype))
            if key not in self._seen:
                self._seen.add(key)
                self.entries.append((shape, shape.dtype(dtype)))


def reference_tokens(tokens: Iterable[int]) -> int:
    """The token count the variants are compared at first: the middle one of the sweep's."""
    ordered = sorted(set(tokens))
    return ordered[len(ordered) // 2]


def attention_batch(seq_len: int, tokens: int) -> int:
    return max(1, tokens // seq_len)


def head_seq_len(seq_lens: list[int]) -> int:
    """The sequence length the head-dim variants' attention is measured at."""
    return max([s for s in seq_lens if s <= 1024] or [min(seq_lens)])


def plan_sweep(dims: ModelDims, dtype: str, tokens: list[int], seq_lens: list[int]) -> list[tuple[GemmShape, str]]:
    """(shape, dtype) in measuring order: the preset at every token count and sequence length; each
    dimension's variants at the reference token count; then the variants at the other token counts."""
    plan = _Plan()
    ref = reference_tokens(tokens)
    for n in sorted(tokens):
        plan.add(model_gemms(dims, n), dtype)
    for s in seq_lens:
        plan.add([attention_shape(dims, s, attention_batch(s, ref))], dtype)
    variants = {name: variant_values(getattr(dims, f))[1:] for name, f in DIM_FIELDS.items()}
    head_seq = head_seq_len(seq_lens)
    for rank in range(max(len(v) for v in variants.values())):
        for name, values in variants.items():
            if rank < len(values):
                changed = dims.replace(**{DIM_FIELDS[name]: values[rank]})
                plan.add(model_gemms(changed, ref), dtype)
                if name == "head_dim":
                    plan.add([attention_shape(changed, head_seq, attention_batch(head_seq, ref))], dtype)
    for n in sorted(tokens):
        for name, values in variants.items():
            for value in values:
                plan.add(model_gemms(dims.replace(**{DIM_FIELDS[name]: value}), n), dtype)
    return plan.entries
