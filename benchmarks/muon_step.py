"""Optimizer step of zaya.optim.Muon against torch.optim.Muon, on all Muon matrices of a preset.

Both sides get the same matrices and the same random gradients, with the same hyperparameters (bf16
Newton-Schulz, 5 steps, Nesterov, match_rms_adamw). torch.optim.Muon takes 2-D parameters only, so each
expert of a stacked [E, m, n] tensor is given to it as its own parameter, as its documentation prescribes.
The two steps are timed alternately, several rounds, and the fastest of each side is compared (the minimum
is the least disturbed by other work on the machine; medians are printed too). Run:

    python benchmarks/muon_step.py [--presets tiny small] [--rounds 5]

It then prints:
- Newton-Schulz throughput: the FLOPs of the iteration (per matrix, k = min(m, n), l = max(m, n):
  steps x (4 k^2 l + 2 k^3)) over the time of our batched `newton_schulz` on all matrices, as a fraction
  of the machine's bf16 matmul peak for the same shapes, measured in the same run as the time of bare
  `torch.bmm` calls of exactly the iteration's operand shapes (3 per step, no other work);
- torch's own Newton-Schulz (`torch.optim._muon._zeropower_via_newtonschulz`, matrix by matrix) timed
  alone, i.e. how much of its step is bookkeeping around the iteration; and the ceiling on the speedup on
  this machine: torch's step over the bare-bmm time of the iteration (what ours would reach if its step were
  nothing but the iteration's matmuls at the bare bmm rate);
- the projected optimizer share of a ZAYA1-base step: Newton-Schulz FLOPs of all its Muon matrices over
  6 x active parameters x tokens per step (4M tokens), i.e. at equal FLOP/s, without any sharding of the
  Newton-Schulz work across ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch

import zaya
from common import header
from zaya.model.params import parameter_report
from zaya.optim.hybrid import split_parameters
from zaya.optim.muon import Muon
from zaya.optim.ns_iteration import newton_schulz, newton_schulz_flops

TOKENS_PER_STEP = 4 * 1024 * 1024
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")


def muon_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors the Muon groups of `split_parameters` hold: 2-D matrices and stacked [E, m, n] experts."""
    return [p.detach() for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_steps(tensors: list[torch.Tensor], rounds: int) -> tuple[list[float], list[float], float | None]:
    """(ours, torch's) step times over `rounds` alternating rounds, after one untimed step each, and the
    fastest time of torch's Newton-Schulz alone on all its matrices (None if this torch lacks the function)."""
    generator = torch.Generator().manual_seed(0)
    ours_params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in ours_params:
        p.grad = torch.randn(p.shape, generator=generator)
    torch_params = []
    for p in ours_params:
        for matrix, grad in zip(p.data.reshape(-1, *p.shape[-2:]), p.grad.reshape(-1, *p.shape[-2:]), strict=True):
            q = torch.nn.Parameter(matrix.clone())
            q.grad = grad.clone()
            torch_params.append(q)
    ours = Muon(ours_params, **HYPER, ns_dtype=torch.bfloat16)
    reference = torch.optim.Muon(torch_params, **HYPER)
    ours.step()
    reference.step()
    ours_times, torch_times = [], []
    for _ in range(rounds):
        ours_times.append(timed(ours.step))
        torch_times.append(timed(reference.step))
    return ours_times, torch_times, torch_newton_schulz(reference, rounds)


def torch_newton_schulz(optimizer: torch.optim.Muon, rounds: int) -> float | None:
    """The fastest of `rounds` timings of torch's Newton-Schulz on the gradient of every parameter of
    `optimizer`, one by one, with its settings."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError:  # a private function: other torch versions may not have it
        return None
    group = optimizer.param_groups[0]

    def run() -> None:
        for p in group["params"]:
            _zeropower_via_newtonschulz(p.grad, group["ns_coefficients"], group["ns_steps"], group["eps"])

    run()
    return min(timed(run) for _ in range(rounds))


def matrix_shapes(tensors: list[torch.Tensor]) -> Counter:
    """How many matrices of each [m, n] the tensors hold."""
    shapes: Counter = Counter()
    for t in tensors:
        shapes[tuple(t.shape[-2:])] += t.shape[0] if t.ndim == 3 else 1
    return shapes


def bench_newton_schulz(shapes: Counter, steps: int, rounds: int) -> tuple[float, float, float]:
    """(FLOPs, our seconds, bare-bmm seconds) of Newton-Schulz on all matrices, one batch per shape."""
    flops = sum(count * newton_schulz_flops(m, n, steps) for (m, n), count in shapes.items())
    stacks = {shape: torch.randn(count, *shape) for shape, count in shapes.items()}
    operands = {}
    for (m, n), count in shapes.items():
        k, l = min(m, n), max(m, n)
        X = torch.randn(count, k, l).bfloat16()
        A = torch.randn(count, k, k).bfloat16()
        operands[(m, n)] = (X, A, torch.empty(count, k, k, dtype=torch.bfloat16), torch.empty_like(X))

    def ours() -> None:
        for G in stacks.values():
            newton_schulz(G, steps, dtype=torch.bfloat16)

    def bare() -> None:
        for X, A, AA, AX in operands.values():
            for _ in range(steps):
                torch.bmm(X, X.mT, out=AA)
                torch.bmm(A, A, out=AA)
                torch.bmm(A, X, out=AX)

    ours()
    bare()
    ours_times, bare_times = [], []
    for _ in range(rounds):
        ours_times.append(timed(ours))
        bare_times.append(timed(bare))
    return flops, min(ours_times), min(bare_times)


def zaya1_base_projection() -> None:
    config = zaya.get_preset("zaya1-base")
    with torch.device("meta"):
        model = zaya.Zaya(config)
    tensors = [p for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params]
    ns_flops = sum(count * newton_schulz_flops(m, n) for (m, n), count in matrix_shapes(tensors).items())
    active = parameter_report(config).active
    model_flops = 6 * active * TOKENS_PER_STEP
    print("\n## projected optimizer share of a ZAYA1-base step")
    print("share = NS FLOPs / (6 x active params x tokens per step), NS FLOPs = sum over Muon matrices of")
    print("        5 x (4 k^2 l + 2 k^3), k = min(m, n), l = max(m, n)")
    print(f"NS FLOPs per step       {ns_flops:.3e}  ({sum(matrix_shapes(tensors).values()):,} matrices)")
    print(f"model FLOPs per step    {model_flops:.3e}  (6 x {active:,} active x {TOKENS_PER_STEP:,} tokens)")
    print(f"share                   {ns_flops / model_flops:.2%}  (at equal FLOP/s; every rank computing "
          f"all of it, i.e. before the owner-rank scheme divides it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    header("Muon optimizer step: zaya.optim.Muon vs torch.optim.Muon (bf16 Newton-Schulz, 5 steps)")
    print(f"# load average at start: {load_average()} (other work on the machine slows both sides unevenly)")
    targets = {"tiny": 1.5, "small": 1.1}
    for preset in args.presets:
        model = zaya.build_model(preset)
        tensors = muon_tensors(model)
        shapes = matrix_shapes(tensors)
        print(f"\n## {preset}: {len(tensors)} tensors, {sum(shapes.values())} matrices, "
              f"{sum(t.numel() for t in tensors):,} parameters")
        print("shapes  " + ", ".join(f"{count} x {m}x{n}" for (m, n), count in sorted(shapes.items())))
        ours, reference, torch_ns = bench_steps(tensors, args.rounds)
        speedup = min(reference) / min(ours)
        paired = statistics.median(r / o for o, r in zip(ours, reference, strict=True))
        target = targets.get(preset)
        verdict = "" if target is None else f"  (target >= {target}x: {'met' if speedup >= target else 'NOT met'})"
        print(f"optimizer step  zaya {min(ours) * 1e3:9.1f} ms (median {statistics.median(ours) * 1e3:.1f})   "
              f"torch {min(reference) * 1e3:9.1f} ms (median {statistics.median(reference) * 1e3:.1f})   "
              f"speedup {speedup:.2f}x{verdict}; median of the per-round ratios {paired:.2f}x")
        flops, ns_time, bare_time = bench_newton_schulz(shapes, 5, args.rounds)
        fraction = bare_time / ns_time
        print(f"Newton-Schulz   {flops / 1e9:.1f} GFLOP: zaya {flops / ns_time / 1e9:.0f} GFLOP/s, bf16 bmm peak for "
              f"the same shapes {flops / bare_time / 1e9:.0f} GFLOP/s, fraction {fraction:.2f}  "
              f"(target >= 0.8: {'met' if fraction >= 0.8 else 'NOT met'})")
        if torch_ns is not None:
            print(f"torch's Newton-Schulz alone {torch_ns * 1e3:.1f} ms: {1 - torch_ns / min(reference):.0%} of its "
                  f"step is bookkeeping around the iteration")
        print(f"ceiling on the speedup here: torch's step / the bare-bmm time of the iteration = "
              f"{min(reference) / bare_time:.2f}x")
    print(f"\n# load average at end: {load_average()}")
    zaya1_base_projection()


def load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
