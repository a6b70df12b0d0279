"""`zaya shapes`: time the GEMMs a model of a preset runs, on this device, across hidden sizes, expert widths
and head dims around the preset, and keep the rates as the efficiency table `zaya plan --device local` uses.

The GEMMs it times, and the variants around the preset, are in `gemms.py`; what the rates recommend, and the
text `zaya shapes` prints, in `shapes_report.py`.

Timing: one warm-up call, then calls until 0.05 s have passed and at least 3 were timed (calls slower than
0.3 s are timed once), the median; calls of under a millisecond are timed in batches. The peak (square
matmuls, `zaya.device.measure_matmul_flops`) is timed before and after the shapes and the larger kept.
A shape whose FLOPs would take over `shape_cap_s` at the measured peak, or whose operands would fill over a
quarter of the device's memory, is skipped, and so is everything left once the sweep's time budget is
spent: the preset's own shapes come first, then the variants at the reference token count, then the rest.
Skipped shapes are counted, and `EfficiencyTable.gemm_rate` interpolates over them.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from zaya.errors import ZayaError
from zaya.plan.gemms import GemmShape, ModelDims, plan_sweep
from zaya.plan.sweep_defaults import DEFAULT_BUDGET_S, DEFAULT_SEQ_LENS, DEFAULT_SHAPE_CAP_S, DEFAULT_TOKENS
from zaya.plan.table import (
    DTYPES,
    EfficiencyTable,
    GemmRecord,
    dtype_name,
    gemm_bytes,
    torch_dtype,
)
from zaya.schema import shown

# ---- timing ---------------------------------------------------------------------------------------------


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


# ---- the sweep ------------------------------------------------------------------------------------------

MAX_TOKENS = 1 << 24  # tokens per micro-batch and sequence lengths: the bound of `data.seq_len` (zaya.config)
MAX_SIZES = 64  # token counts or sequence lengths in one sweep


def check_sizes(what: str, values: Iterable[int], bound: int = MAX_TOKENS) -> list[int]:
    """`values` sorted and deduplicated, each an integer in 1..`bound`, at most `MAX_SIZES` of them."""
    values = list(values)
    if not values or len(values) > MAX_SIZES:
        raise ZayaError(f"{what}: give 1 to {MAX_SIZES} values, got {len(values)}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ZayaError(f"{what} must be integers in 1..{bound:,}, got {shown(value)}")
    return sorted(set(values))



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
    tokens = check_sizes("token counts", DEFAULT_TOKENS if tokens is None else tokens, MAX_TOKENS)
    seq_lens = check_sizes("sequence lengths", DEFAULT_SEQ_LENS if seq_lens is None else seq_lens, MAX_TOKENS)
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
    if not records:  # an empty table would stand in for a measurement: `zaya plan` would divide by nothing
        reasons = ", ".join(f"{count} {reason}" for reason, count in skipped.items() if count)
        raise ZayaError(f"no shape could be measured ({len(entries)} skipped: {reasons}): give fewer or smaller "
                        "token counts (--tokens), or more time (--budget-s)")
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
