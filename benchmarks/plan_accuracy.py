"""The planner's predictions against real runs of this machine, for every configuration
`tests/plan/test_accuracy.py` runs (`zaya.plan.compare`): memory, bytes on the wire and step time, each with
its error and the tolerance the tests hold it to.

    python benchmarks/plan_accuracy.py [--only memory|time] [--cases N] [--steps 1]
                                       [--table PRESET=PATH ...]

- Memory and traffic (`ACCURACY_CASES`, 1 to 4 ranks: FSDP2, HSDP, context parallelism, activation
  checkpointing, bf16): each case runs `zaya.plan.measure.measured_step` on its gloo ranks (fresh processes,
  one intra-op thread each, torchrun's environment), and `predicted_step(case, rank)` predicts each rank.
  Compared: the training state a rank holds (parameters + gradients + optimizer state, within 5%), the bytes
  autograd saves for backward in one micro-batch (within 20%), and, past one rank, the bytes a rank sends in
  one step, in total and for every kind of collective above 1% of the total (within 10%).
- Step time (`TIME_CASES`): one process, with this machine's default intra-op thread count, runs 5 steps;
  the median after the first is measured against `predicted_step(case, table=table)["seconds"]` (within 25%),
  `table` being the GEMM efficiency table `zaya.plan.shapes.sweep` measures here for the case's preset
  (fp32, 1,024 tokens, a 40 s budget), or one `zaya shapes --out PATH` wrote, given as --table PRESET=PATH.

Printed per case and quantity: rank 0's figures and, past one rank, those of the rank with the largest error
(one row, marked, where that is rank 0): measured, predicted, the signed error predicted / measured - 1, the
tolerance and ok / FAIL; then the worst error of each quantity over all cases. A FAIL is reported, not
raised: the script exits 0 unless a measurement itself fails (exit 1). A whole run takes about 5 minutes
on a quiet 2-core machine (12 beside another job); the sweeps' rates and the timed steps are only meaningful
on a quiet one (a loaded one gave +150% for `small`): reuse a quiet machine's tables with --table.

On a GPU machine: `--device cuda` is not supported yet. The same command runs there unchanged: the memory
and traffic cases on gloo ranks of the CPU (the planner's CPU choices, as the tests do), and the step time
of one CPU process against the local table the sweep measures on the CPU (`measured_step` runs on the CPU
only; a GPU step time would need a GPU path in it and a `zaya shapes` table of the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from common import header, run_ranks

TOLERANCES = {"state": 0.05, "activations": 0.20, "traffic": 0.10, "seconds": 0.25}


def _rank(rank: int, world: int, port: int, kwargs: dict, steps: int, threads: int, out: str) -> None:
    """One rank of a measured case: torchrun's environment, `threads` intra-op threads, `measured_step`."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    import warnings

    warnings.filterwarnings("ignore")
    from zaya.parallel.launch import Launch
    from zaya.plan.measure import measured_step

    result = measured_step(Launch.from_env(os.environ), **kwargs, steps=steps)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def case_id(case) -> str:
    """As the ids of tests/plan/test_accuracy.py: preset-precision-Nrank[-hsdpR][-cpC-kernel][-ac-mode]."""
    extra = f"-hsdp{case.dp_replicate}" if case.dp_replicate > 1 else ""
    extra += f"-cp{case.cp}-{case.cp_kernel}" if case.cp > 1 else ""
    extra += f"-ac-{case.activation_checkpointing}" if case.activation_checkpointing != "none" else ""
    return f"{case.preset}-{case.precision}-{case.world}rank{extra}"


def _bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.3f} {unit}"
    return f"{value:,.0f} B"


def _seconds(value: float) -> str:
    return f"{value:.3f} s"


class Report:
    """The table's rows as they come, and the worst error of each quantity."""

    COLUMNS = f"{'case':<36} {'rank':<7} {'quantity':<28} {'measured':>13} {'predicted':>13} {'error':>8} " \
              f"{'tol':>5} {'':>4}"

    def __init__(self) -> None:
        self.worst: dict[str, tuple[float, str]] = {}
        self.failures = 0
        self.rows = 0

    def row(self, case: str, rank: str, quantity: str, measured: float, predicted: float, tolerance: float,
            unit=_bytes) -> None:
        error = predicted / measured - 1 if measured else float("inf")
        ok = abs(error) <= tolerance
        self.failures += not ok
        self.rows += 1
        print(f"{case:<36} {rank:<7} {quantity:<28} {unit(measured):>13} {unit(predicted):>13} {error:+8.1%} "
              f"{tolerance:5.0%} {'ok' if ok else 'FAIL':>4}", flush=True)
        if quantity not in self.worst or abs(error) > abs(self.worst[quantity][0]):
            self.worst[quantity] = (error, f"{case} rank {rank.split()[0]}")

    def summary(self) -> None:
        print(f"# worst error per quantity ({self.rows} rows, {self.failures} outside tolerance):")
        for quantity, (error, where) in self.worst.items():
            print(f"#   {quantity:<28} {error:+8.1%}  ({where})")


def _compare(report: Report, name: str, quantity: str, values: list[tuple[float, float]], tolerance: float,
             unit=_bytes) -> None:
    """Rank 0's row, and the row of the rank with the largest |error| where it is another one (values: one
    (measured, predicted) per rank, None for a rank where the quantity does not apply)."""
    ranks = [r for r, value in enumerate(values) if value is not None]
    if not ranks:
        return

    def error(r: int) -> float:
        measured, predicted = values[r]
        return abs(predicted / measured - 1) if measured else float("inf")

    worst = max(ranks, key=error)
    many = len(values) > 1
    if 0 in ranks:
        report.row(name, "0 worst" if many and worst == 0 else "0", quantity, *values[0], tolerance, unit)
    if many and (worst != 0 or 0 not in ranks):
        report.row(name, f"{worst} worst", quantity, *values[worst], tolerance, unit)


def memory_part(report: Report, cases, steps: int) -> bool:
    """The memory and traffic comparisons; False where a measurement failed."""
    from zaya.plan.compare import predicted_step

    ok = True
    for case in cases:
        name = case_id(case)
        started = time.perf_counter()
        try:
            measured = run_ranks(_rank, case.world, case.measure_kwargs(), steps, 1)
        except (Exception, SystemExit) as error:  # run_ranks raises SystemExit for a failed rank
            print(f"{name:<36} measurement failed: {error}", flush=True)
            traceback.print_exc()
            ok = False
            continue
        predicted = [predicted_step(case, rank) for rank in range(case.world)]
        pairs = list(zip(measured, predicted, strict=True))
        _compare(report, name, "state bytes", [(sum(m["state"].values()), sum(p["state"].values()))
                                               for m, p in pairs], TOLERANCES["state"])
        _compare(report, name, "activations", [(m["activations"], p["activations"])
                                               for m, p in pairs], TOLERANCES["activations"])
        if case.world > 1:
            _compare(report, name, "traffic total", [(sum(m["comm"].values()), sum(p["comm"].values()))
                                                     for m, p in pairs], TOLERANCES["traffic"])
            kinds = sorted({kind for m in measured for kind in m["comm"]})
            for kind in kinds:
                values = []
                for m, p in pairs:
                    sent, nbytes = sum(m["comm"].values()), m["comm"].get(kind, 0)
                    values.append((nbytes, p["comm"].get(kind, 0)) if nbytes > 0.01 * sent else None)
                _compare(report, name, f"traffic {kind}", values, TOLERANCES["traffic"])
            # kinds the planner predicts that the run did not send: shown, not judged by the tests
            for kind in sorted({k for p in predicted for k in p["comm"]} - set(kinds)):
                nbytes = predicted[0]["comm"].get(kind, 0)
                if nbytes > 0.01 * sum(predicted[0]["comm"].values()):
                    print(f"{name:<36} {'0':<7} {'traffic ' + kind:<28} {'(none sent)':>13} {_bytes(nbytes):>13}",
                          flush=True)
        print(f"#   {name}: {time.perf_counter() - started:.0f} s", flush=True)
    return ok


def time_part(report: Report, cases, tables: dict[str, str], budget_s: float) -> bool:
    """The step-time comparisons; False where a measurement failed."""
    from zaya.plan.compare import predicted_step
    from zaya.plan.shapes import sweep
    from zaya.plan.table import EfficiencyTable

    threads = torch.get_num_threads()
    ok = True
    for case in cases:
        name = f"{case.preset}-{case.precision}-time"
        started = time.perf_counter()
        try:
            if case.preset in tables:
                table = EfficiencyTable.load(tables[case.preset])
            else:
                table = sweep(case.preset, "cpu", case.precision, tokens=[1024], progress=False, budget_s=budget_s)
            swept = time.perf_counter() - started
            measured = run_ranks(_rank, 1, case.measure_kwargs(), 5, threads)[0]["seconds"]
        except (Exception, SystemExit) as error:
            print(f"{name:<36} measurement failed: {error}", flush=True)
            traceback.print_exc()
            ok = False
            continue
        predicted = predicted_step(case, table=table)["seconds"]
        report.row(name, "0", "step seconds", measured, predicted, TOLERANCES["seconds"], _seconds)
        source = f"table {tables[case.preset]}" if case.preset in tables else f"sweep {swept:.0f} s"
        print(f"#   {name}: {case.micro_batches} x {case.micro_batch_size} x {case.seq_len} tokens, {threads} "
              f"threads, {source}, {time.perf_counter() - started:.0f} s", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["memory", "time"], help="run one part only")
    parser.add_argument("--cases", type=int, help="the first N accuracy (memory and traffic) cases only")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per memory/traffic case (the last "
                        "one is measured)")
    parser.add_argument("--table", action="append", default=[], metavar="PRESET=PATH",
                        help="a table `zaya shapes` wrote for PRESET, instead of sweeping here")
    parser.add_argument("--budget-s", type=float, default=40.0, help="seconds each sweep spends on shapes")
    args = parser.parse_args()
    tables = {}
    for item in args.table:
        preset, sep, path = item.partition("=")
        if not sep:
            parser.error(f"--table takes PRESET=PATH, got {item!r}")
        tables[preset] = path

    from zaya.plan.compare import ACCURACY_CASES, TIME_CASES

    header("zaya plan: predicted against measured")
    print(f"# error = predicted / measured - 1; {os.cpu_count()} cores; memory/traffic on gloo ranks, 1 thread "
          f"each; step time in one process, {torch.get_num_threads()} threads")
    print(Report.COLUMNS)
    report = Report()
    ok = True
    started = time.perf_counter()
    if args.only != "time":
        cases = ACCURACY_CASES[:args.cases] if args.cases is not None else ACCURACY_CASES
        ok &= memory_part(report, cases, args.steps)
    if args.only != "memory":
        ok &= time_part(report, TIME_CASES, tables, args.budget_s)
    report.summary()
    print(f"# total {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
