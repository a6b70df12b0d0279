"""`zaya shapes`: time the GEMMs a model of a preset runs, on this device, across hidden sizes, expert widths
and head dims around the preset, and keep the rates as the efficiency table `zaya plan --device local` uses.

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

Timing: one warm-up call, then calls until 0.05 s have passed and at least 3 were timed (calls slower than
0.3 s are timed once), the median; calls of under a millisecond are timed in batches. The peak (square
matmuls, `zaya.device.measure_matmul_flops`) is timed before and after the shapes and the larger kept.
A shape whose FLOPs would take over `shape_cap_s` at the measured peak, or whose operands would fill over a
quarter of the device's memory, is skipped, and so is everything left once the sweep's time budget is
spent: the preset's own shapes come first, then the variants at the reference token count, then the rest.
Skipped shapes are counted, and `EfficiencyTable.gemm_rate` interpolates over them.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from zaya.errors import ZayaError
from zaya.plan.table import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    OPS,
    EfficiencyTable,
    GemmRecord,
    cache_dir,
    default_table_path,
    dtype_name,
    gemm_bytes,
    gemm_flops,
    torch_dtype,
)

# the table's names, importable from here as from `zaya.plan.table`
__all__ = ["DTYPES", "FORMAT", "FORMAT_VERSION", "OPS", "EfficiencyTable", "GemmRecord", "cache_dir",
           "default_table_path", "dtype_name", "gemm_bytes", "gemm_flops", "torch_dtype"]

DEFAULT_TOKENS = (1024, 2048, 4096, 8192)
DEFAULT_SEQ_LENS = (256, 512, 1024, 2048, 4096)
DEFAULT_BUDGET_S = 60.0
DEFAULT_SHAPE_CAP_S = 2.0

# which GEMMs change with each dimension a sweep varies
DIMENSIONS = {
    "hidden_size": ("attn_in", "attn_out", "router_down", "expert_gate_up", "expert_down", "lm_head",
                    "lm_grad_hidden", "lm_grad_weight"),
    "moe_intermediate_size": ("expert_gate_up", "expert_down"),
    "head_dim": ("attn_in", "attn_out", "attention"),
}
ALIGNMENTS = (8, 16, 32, 64, 128, 256)


# ---- shapes ---------------------------------------------------------------------------------------------


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


# ---- measuring ------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], object], device: torch.device, min_s: float = 0.05, max_s: float = 0.3,
              min_calls: int = 3) -> float:
    """Median seconds of one `fn()` (see the module docstring)."""
    from zaya.device import synchronize

    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    first = time.perf_counter() - start
    batch = max(1, min(1000, int(1e-3 / max(first, 1e-7))))
    samples = [first] if batch == 1 else []
    spent = first
    while not ((len(samples) >= min_calls and spent >= min_s) or (samples and spent >= max_s)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        synchronize(device)
        elapsed = time.perf_counter() - start
        samples.append(elapsed / batch)
        spent += elapsed
    return statistics.median(samples)


def _gemm_call(shape: GemmShape, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    """A closure running `shape` once, on fresh random operands."""
    m, n, k = shape.m, shape.n, shape.k

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype)

    if shape.op == "attention":
        B, Hq, Hk, T, d = shape.batch, shape.k, shape.groups, shape.m, shape.n
        q = rand(B, Hq, T, d).requires_grad_()
        kv = [rand(B, Hk, T, d).requires_grad_() for _ in range(2)]
        grad_out = rand(B, Hq, T, d)

        def attention():
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
                return torch.autograd.grad(out, (q, *kv), grad_out)

        return attention
    if shape.op == "grouped":
        E = shape.groups
        x, w = rand(m, k), rand(E, n, k)  # the experts' layout: [E, out, in]
        sizes = [m // E + (1 if e < m % E else 0) for e in range(E)]
        if hasattr(torch, "_grouped_mm"):
            offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
            return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        padded = torch.zeros(E, max(sizes), k, device=device, dtype=dtype)  # the padded-bmm fallback
        return lambda: torch.bmm(padded, w.transpose(-2, -1))
    if shape.layout == "nn":
        a, b = rand(m, k), rand(k, n)
        return lambda: a @ b
    if shape.layout == "tn":
        a, b = rand(k, m), rand(k, n)
        return lambda: a.t() @ b
    x, w = rand(m, k), rand(n, k)
    return lambda: F.linear(x, w)


def measure_bandwidth(device: torch.device, megabytes: int = 256) -> float:
    """Bytes/s of `out = a + b` over fp32 tensors of `megabytes` MiB (3 x the bytes per call): large enough
    to spill the last-level caches of CPUs and GPUs alike (MI300X's Infinity Cache is 256 MiB)."""
    numel = (megabytes << 20) // 4
    a = torch.randn(numel, device=device)
    b, out = torch.randn_like(a), torch.empty_like(a)
    seconds = time_call(lambda: torch.add(a, b, out=out), device, min_s=0.1)
    return 3 * numel * 4 / seconds


def measure_op_overhead(device: torch.device, calls: int = 200) -> float:
    """Seconds per dispatch of a tiny op (`x.add_(1)` on one element), the median of 5 runs of `calls`."""
    from zaya.device import synchronize

    x = torch.zeros(1, device=device)
    x.add_(1)
    samples = []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            x.add_(1)
        synchronize(device)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


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


_DIM_FIELDS = {"hidden_size": "hidden_size", "moe_intermediate_size": "moe_intermediate_size",
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


def _head_seq_len(seq_lens: list[int]) -> int:
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
    variants = {name: variant_values(getattr(dims, f))[1:] for name, f in _DIM_FIELDS.items()}
    head_seq = _head_seq_len(seq_lens)
    for rank in range(max(len(v) for v in variants.values())):
        for name, values in variants.items():
            if rank < len(values):
                changed = dims.replace(**{_DIM_FIELDS[name]: values[rank]})
                plan.add(model_gemms(changed, ref), dtype)
                if name == "head_dim":
                    plan.add([attention_shape(changed, head_seq, attention_batch(head_seq, ref))], dtype)
    for n in sorted(tokens):
        for name, values in variants.items():
            for value in values:
                plan.add(model_gemms(dims.replace(**{_DIM_FIELDS[name]: value}), n), dtype)
    return plan.entries


def sweep(
    preset: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    tokens: Iterable[int] | None = None,
    progress: bool = True,
    budget_s: float | None = DEFAULT_BUDGET_S,
    shape_cap_s: float = DEFAULT_SHAPE_CAP_S,
    seq_lens: Iterable[int] | None = None,
) -> EfficiencyTable:
    """Measure the GEMMs of `preset` and its variants on `device` (default: the accelerator, else the CPU)
    in `dtype` (default: `zaya.device.default_gemm_dtype`). `budget_s` bounds the time spent on shapes
    (None: no bound); see the module docstring for what is measured and skipped."""
    from zaya.device import (
        default_gemm_dtype,
        device_label,
        device_memory_bytes,
        measure_matmul_flops,
        resolve_device,
    )
    from zaya.model.presets import get_preset

    config = get_preset(preset)
    device = resolve_device(device)
    torch_dt = default_gemm_dtype(device) if dtype is None else (torch_dtype(dtype) if isinstance(dtype, str)
                                                                  else dtype)
    name = dtype_name(torch_dt)
    tokens = sorted(set(DEFAULT_TOKENS if tokens is None else tokens))
    if not tokens or min(tokens) <= 0:
        raise ZayaError(f"token counts must be positive, got {tokens}")
    seq_lens = sorted(set(DEFAULT_SEQ_LENS if seq_lens is None else seq_lens))
    seq_lens = [s for s in seq_lens if s <= config.max_position_embeddings] or [min(seq_lens)]
    dims = ModelDims.from_config(config)

    peaks = {name: measure_matmul_flops(device, torch_dt, size=8192)}
    for other in ("fp32", "bf16"):
        if other not in peaks:
            peaks[other] = measure_matmul_flops(device, DTYPES[other], size=8192)
    memory = device_memory_bytes(device)
    bandwidth = measure_bandwidth(device, 256 if memory >= 8 << 30 else 64)
    overhead = measure_op_overhead(device)

    entries = plan_sweep(dims, name, tokens, seq_lens)
    records: list[GemmRecord] = []
    skipped = {"slow": 0, "memory": 0, "budget": 0, "failed": 0}
    from tqdm import tqdm

    bar = tqdm(total=len(entries), unit="shape", desc=f"shapes {preset} {name}", file=sys.stderr,
               disable=not (progress and sys.stderr.isatty()), dynamic_ncols=True, leave=False)
    start = time.perf_counter()
    try:
        for shape, shape_dtype in entries:
            bar.update(1)
            moved = gemm_bytes(shape.op, shape.m, shape.n, shape.k, shape.groups, DTYPES[shape_dtype].itemsize,
                               shape.batch)
            if shape.flops / peaks[shape_dtype] > shape_cap_s:
                skipped["slow"] += 1
            elif memory and moved > memory / 4:
                skipped["memory"] += 1
            elif budget_s is not None and time.perf_counter() - start > budget_s:
                skipped["budget"] += 1
            else:
                try:
                    with torch.no_grad():
                        seconds = time_call(_gemm_call(shape, device, DTYPES[shape_dtype]), device)
                except (RuntimeError, NotImplementedError):  # a kernel that rejects the shape or dtype
                    skipped["failed"] += 1
                    continue
                records.append(GemmRecord(shape.op, shape.m, shape.n, shape.k, shape.groups, shape_dtype,
                                          seconds, shape.flops, shape.kind))
    finally:
        bar.close()
    # timed again after the shapes, the larger kept: a busy moment of the machine does not set the peak
    peaks[name] = max(peaks[name], measure_matmul_flops(device, torch_dt, size=8192))
    table = EfficiencyTable(
        device=str(device), device_label=device_label(device), dtype=name, peak_flops=peaks[name],
        memory_bandwidth=bandwidth, op_overhead_s=overhead, records=records, preset=preset,
        measured_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        torch_version=torch.__version__, peaks=peaks, memory_bytes=memory, tokens=list(tokens), seq_lens=seq_lens,
        skipped={k: v for k, v in skipped.items() if v},
    )
    from zaya.plan.calibrate import measure_elementwise

    rates = measure_elementwise(preset, table, device, min(tokens))
    if rates is not None:
        table.elementwise_factor, table.optimizer_factor = rates.factor, rates.optimizer_factor
    else:
        table.skipped["elementwise"] = 1
    return table


# ---- recommendations ------------------------------------------------------------------------------------


@dataclass
class Recommendation:
    """What the measurements say about one dimension of the model, at `tokens` tokens per micro-batch.

    `efficiency[v]` is the fraction of peak the GEMMs that depend on the dimension reach together (their
    ideal time at the peak over their measured time, each weighted by how often the model runs it) when
    the dimension is v and the others keep the preset's values. `multiple` is the smallest alignment (of
    8 ... 256) whose measured multiples all reach 95% of the best efficiency among values within 25% of
    them, so that misalignment, not size, is what it measures (None if no alignment has two such measured
    multiples that pass); `efficient` are the values within 90% of the best efficiency measured."""

    dimension: str
    preset_value: int
    tokens: int
    efficiency: dict[int, float]
    best: int
    multiple: int | None
    efficient: list[int]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["efficiency"] = {str(v): e for v, e in self.efficiency.items()}
        return data


def _value_efficiency(table: EfficiencyTable, shapes: list[GemmShape]) -> float | None:
    ideal = measured = 0.0
    for shape in shapes:
        dtype = shape.dtype(table.dtype)
        record = table.record(shape.op, shape.m, shape.n, shape.k, shape.groups, dtype)
        if record is None:
            return None
        ideal += shape.count * record.flops / table.peak(dtype)
        measured += shape.count * record.seconds
    return ideal / measured if measured > 0 else None


def _alignment_multiple(efficiency: dict[int, float]) -> int | None:
    """The smallest alignment whose multiples (two at least, each with a measured value within 25%) all
    reach 95% of the best efficiency within 25% of them."""
    def near(v: int) -> list[float]:
        return [e for u, e in efficiency.items() if 0.8 * v <= u <= 1.25 * v]

    for multiple in ALIGNMENTS:
        aligned = [v for v in efficiency if v % multiple == 0 and len(near(v)) > 1]
        if len(aligned) >= 2 and all(efficiency[v] >= 0.95 * max(near(v)) for v in aligned):
            return multiple
    return None


def recommend(table: EfficiencyTable, preset: str | None = None, tokens: int | None = None) -> list[Recommendation]:
    """Per dimension (hidden size, expert width, head dim): the measured efficiency of each value the sweep
    measured around `preset` (default: the table's) at `tokens` (default: the sweep's reference count)."""
    from zaya.model.presets import get_preset

    config = get_preset(preset or table.preset)
    dims = ModelDims.from_config(config)
    tokens = tokens or reference_tokens(table.tokens or DEFAULT_TOKENS)
    head_seq = _head_seq_len(table.seq_lens or sorted({r.m for r in table.records if r.op == "attention"})
                             or list(DEFAULT_SEQ_LENS))
    out = []
    for name, field_name in _DIM_FIELDS.items():
        preset_value = getattr(dims, field_name)
        efficiency = {}
        for value in sorted(variant_values(preset_value)):
            changed = dims.replace(**{field_name: value})
            shapes = [s for s in model_gemms(changed, tokens) if s.kind in DIMENSIONS[name]]
            if name == "head_dim":
                shapes.append(attention_shape(changed, head_seq, attention_batch(head_seq, tokens)))
            e = _value_efficiency(table, shapes)
            if e is not None:
                efficiency[value] = e
        if not efficiency:
            continue
        best_e = max(efficiency.values())
        out.append(Recommendation(
            dimension=name, preset_value=preset_value, tokens=tokens, efficiency=efficiency,
            best=max(efficiency, key=efficiency.get), multiple=_alignment_multiple(efficiency),
            efficient=[v for v, e in efficiency.items() if e >= 0.9 * best_e],
        ))
    return out


# ---- text -----------------------------------------------------------------------------------------------


def _rate_unit(peak: float) -> tuple[float, str]:
    return (1e12, "TFLOP/s") if peak >= 1e12 else (1e9, "GFLOP/s")


def format_table(table: EfficiencyTable) -> str:
    """The measurements, one block per GEMM kind: shape, ms, rate, fraction of peak."""
    scale, unit = _rate_unit(table.peak_flops)
    lines = [
        f"device: {table.device_label} ({table.device}), {table.dtype}, torch {table.torch_version}",
        f"peak {table.dtype} matmul: {table.peak_flops / scale:,.1f} {unit} (measured)"
        + "".join(f", {d}: {p / scale:,.1f}" for d, p in table.peaks.items() if d != table.dtype)
        + f"; memory {table.memory_bandwidth / 1e9:,.1f} GB/s; op overhead {table.op_overhead_s * 1e6:.1f} us",
    ]
    kinds: dict[str, list[GemmRecord]] = {}
    for r in table.records:
        kinds.setdefault(r.kind or r.op, []).append(r)
    for kind, records in kinds.items():
        op = records[0].op
        head = ("T", "d", "Hq", "Hk") if op == "attention" else ("m", "n", "k", "groups")
        lines.append("")
        lines.append(f"{kind} ({op}, {records[0].dtype})")
        lines.append(f"  {head[0]:>7} {head[1]:>7} {head[2]:>7} {head[3]:>6} {'ms':>10} {unit:>9} {'of peak':>8}")
        for r in sorted(records, key=lambda r: (r.dtype, r.m, r.n, r.k, r.groups)):
            lines.append(f"  {r.m:>7} {r.n:>7} {r.k:>7} {r.groups:>6} {r.seconds * 1e3:>10.3f} "
                         f"{r.rate / scale:>9.2f} {r.rate / table.peak(r.dtype):>8.1%}")
    return "\n".join(lines)


def format_recommendations(recommendations: list[Recommendation]) -> str:
    lines = []
    for rec in recommendations:
        lines.append(f"{rec.dimension} (preset {rec.preset_value}, {rec.tokens} tokens per micro-batch): "
                     "fraction of peak by value")
        lines.append("  " + "  ".join(f"{v}: {e:.0%}" for v, e in rec.efficiency.items()))
        multiple = f"multiples of {rec.multiple}" if rec.multiple else "no alignment multiple stood out"
        lines.append(f"  align to {multiple}; efficient (>= 90% of the best, {rec.best}): "
                     f"{', '.join(str(v) for v in rec.efficient)}")
    return "\n".join(lines)


def format_skipped(table: EfficiencyTable) -> str:
    if not table.skipped:
        return f"measured {len(table.records)} shapes, none skipped"
    reasons = {"slow": "over the per-shape time cap", "memory": "too large for memory",
               "budget": "past the time budget", "failed": "rejected by the kernel"}
    parts = [f"{count} {reasons.get(reason, reason)}" for reason, count in table.skipped.items()]
    return f"measured {len(table.records)} shapes, skipped {sum(table.skipped.values())} ({', '.join(parts)})"
