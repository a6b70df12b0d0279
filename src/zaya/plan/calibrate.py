"""What a device spends beyond the GEMMs: the model's elementwise work (norms, scalings, routing, the
convolutions' bookkeeping, copies, the loss's softmax passes) and its optimizer's elementwise updates,
measured by running the model itself, so that `zaya plan --device local` predicts whole steps.

The time model (`zaya.plan.timing`) counts the bytes elementwise work moves (each saved activation written,
read, and its gradient written and read; 16 bytes per logit; 28 per AdamW element, ...). A streaming copy's
bandwidth explains that work badly on a CPU: elementwise ops over a few MB run far below it (composite
kernels make several passes, reductions and transposed copies do not stream, log and exp are
compute-bound), and no bandwidth figure says by how much. So `zaya shapes` times the preset's model
(forward and backward of the loss; then an optimizer step of its one-block version) and divides what is
left once the GEMM table, the attention rate and the operator count are taken away by what the bytes model
predicts for it:

    elementwise_factor = (step - GEMMs - attention - operators) / (elementwise bytes / bandwidth)
    optimizer_factor   = (optimizer step - Newton-Schulz GEMMs) / (its bytes / bandwidth)

Both are properties of the device running this model's code, for any shape of the family.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from zaya.model.presets import get_preset


@dataclass(frozen=True)
class Elementwise:
    """How much slower than the bytes model the device runs the model's (and the optimizer's) elementwise
    work."""

    factor: float
    optimizer_factor: float


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    from zaya.device import synchronize

    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _ns_dtype(precision: str) -> str:
    return "bfloat16" if precision == "bf16" else "float32"


def _time_model(config, device: torch.device, tokens: int, precision: str, repeats: int,
                optimizer: bool) -> tuple[float, float]:
    """(forward + backward of the loss, one optimizer step if `optimizer`): median seconds for a model of
    `config`."""
    from zaya.model.transformer import Zaya
    from zaya.optim.config import OptimConfig
    from zaya.optim.hybrid import build_optimizer

    torch.manual_seed(0)
    model = Zaya(config).to(device)
    ids = torch.randint(0, config.vocab_size, (1, tokens + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()

    forward_backward = _median_seconds(step, device, repeats)
    if not optimizer:
        return forward_backward, 0.0
    optim = build_optimizer(model, OptimConfig(ns_dtype=_ns_dtype(precision)))
    return forward_backward, _median_seconds(optim.step, device, max(2, repeats))


def measure_elementwise(preset: str, table, device: torch.device, tokens: int, repeats: int = 5,
                        cap_s: float = 10.0) -> Elementwise | None:
    """The factors of the module docstring for `preset` on `device`, in `table`'s dtype, at `tokens` tokens
    (one sequence); None where a step would take over `cap_s` by the table (a large model on a CPU)."""
    from zaya.device import grouped_mm_row_multiple, loss_chunk_logits, tune_host_allocator
    from zaya.plan.layout import Layout
    from zaya.plan.memory import DeviceDetails
    from zaya.plan.timing import optimizer_seconds, step_time
    from zaya.plan.traffic import Traffic

    tune_host_allocator()  # as the trainer does: freed memory is reused, not faulted in anew
    precision = "bf16" if table.dtype == "bf16" else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    details = DeviceDetails(grouped_mm_row_multiple(device, dtype), loss_chunk_logits(device))
    layout = Layout(1, 1, 1, 1, 1, 1, "none")
    config = get_preset(preset, temp_init=1.0)
    # the optimizer's work of one block (of the first block's type: the types differ in attention only)
    one_block = get_preset(preset, num_hidden_layers=1, temp_init=1.0,
                           layer_types=config.layer_types[:1] if config.layer_types else None)
    ns = _ns_dtype(precision)
    uncalibrated = _Uncalibrated(table)
    predicted = step_time(config, layout, tokens, precision, 1, uncalibrated, Traffic(), {}, ns, 5, "allgather",
                          details)
    newton_schulz = optimizer_seconds(one_block, table, layout, ns, 5, gemms_only=True)
    optimizer_bytes = optimizer_seconds(one_block, table, layout, ns, 5) - newton_schulz
    if predicted.total - predicted.optimizer + newton_schulz > cap_s:
        return None
    forward_backward, _ = _time_model(config, device, tokens, precision, repeats, optimizer=False)
    _, optimizer = _time_model(one_block, device, tokens, precision, 1, optimizer=True)
    rest = forward_backward - predicted.gemm - predicted.attention - predicted.overhead
    return Elementwise(max(rest, 0.0) / predicted.elementwise if predicted.elementwise else 1.0,
                       max(optimizer - newton_schulz, 0.0) / optimizer_bytes if optimizer_bytes else 1.0)


class _Uncalibrated:
    """`table` without its elementwise factors: the bytes model's own prediction."""

    def __init__(self, table) -> None:
        self._table = table
        self.memory_bandwidth, self.op_overhead_s = table.memory_bandwidth, table.op_overhead_s

    def gemm_rate(self, *args, **kwargs) -> float:
        return self._table.gemm_rate(*args, **kwargs)

    def attention_rate(self, *args, **kwargs) -> float:
        return self._table.attention_rate(*args, **kwargs)
