"""GEMM efficiency of a preset's shapes on this machine: the sweep `zaya shapes` runs, printed with the machine.

Each GEMM the model runs (attention projections, router, grouped experts, LM head and its fused loss, causal
attention) is timed at the preset's dimensions and at variants around them; the rates are printed as a
fraction of the measured matmul peak, then the dimensions the measurements recommend. Nothing is written to
the cache unless --out is given. Run:

    python benchmarks/gemm_shapes.py [--preset tiny] [--dtype fp32] [--tokens 1024,2048,4096,8192] [--budget-s 60]
"""

from __future__ import annotations

import argparse
import time

from common import header
from zaya.plan.shapes import sweep
from zaya.plan.shapes_report import format_recommendations, format_skipped, format_table, recommend
from zaya.plan.sweep_defaults import DEFAULT_BUDGET_S, DEFAULT_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args()

    header(f"GEMM shapes of preset {args.preset}")
    start = time.perf_counter()
    table = sweep(args.preset, dtype=args.dtype, tokens=[int(t) for t in args.tokens.split(",")], progress=True,
                  budget_s=args.budget_s)
    elapsed = time.perf_counter() - start
    print(format_table(table))
    print()
    print(format_recommendations(recommend(table)))
    print()
    print(f"{format_skipped(table)}; sweep took {elapsed:.1f} s")
    if args.out:
        print(f"wrote {table.save(args.out, overwrite=args.overwrite)}")


if __name__ == "__main__":
    main()
