"""What a sweep's measurements say (`zaya shapes`): the efficiency of each value of a dimension around the
preset and the alignment it rewards, and the table, the recommendations and the skipped shapes as text."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zaya.plan.gemms import (
    DIM_FIELDS,
    GemmShape,
    ModelDims,
    attention_batch,
    attention_shape,
    head_seq_len,
    model_gemms,
    reference_tokens,
    variant_values,
)
from zaya.plan.sweep_defaults import DEFAULT_SEQ_LENS, DEFAULT_TOKENS
from zaya.plan.table import EfficiencyTable, GemmRecord

# which GEMMs change with each dimension a sweep varies
DIMENSIONS = {
    "hidden_size": ("attn_in", "attn_out", "router_down", "expert_gate_up", "expert_down", "lm_head",
                    "lm_grad_hidden", "lm_grad_weight"),
    "moe_intermediate_size": ("expert_gate_up", "expert_down"),
    "head_dim": ("attn_in", "attn_out", "attention"),
}
ALIGNMENTS = (8, 16, 32, 64, 128, 256)


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
    head_seq = head_seq_len(table.seq_lens or sorted({r.m for r in table.records if r.op == "attention"})
                            or list(DEFAULT_SEQ_LENS))
    out = []
    for name, field_name in DIM_FIELDS.items():
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
