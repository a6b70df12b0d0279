"""Attention work per context-parallel rank with packed documents: head-tail sharding against chunks dealt out by
work (`SequenceLayout.balanced`, `parallel.cp_document_chunks` = 4, 8, 16 chunks per rank; and at 8, the greedy
deal alone, without its swaps).

    python benchmarks/cp_balance.py [--rows 200] [--batch 4] [--seed 0] [--json out.json]

Rows are cut one after another from a stream of documents drawn from a length mix, as a data loader packs them
(a row's first token starts a document; its last document is cut at the row's end):

- lognormal lengths of mean 512, 2k and 8k tokens (sigma 1 of the log): pretraining-like text;
- sft: chats of Geometric(1/2) turns (1 or more, 2 on average), each a prompt (lognormal, mean 120, sigma 1)
  and an answer (lognormal, mean 400, sigma 1), one document per chat: a supervised fine-tuning mix;
- one document per row (the causal mask without packing, where head-tail is exact).

For every mix at 32k tokens over cp = 2, 4, 8 and at 131k over cp = 8: the busiest rank's query-key pairs over
the mean rank's (`zaya.parallel.document_balance`: the pairs the mask allows, what each rank waits on), median and
p90 over --rows sampled rows, and the same over micro-batches of --batch rows planned together (one layout
serves a micro-batch); and the host time to plan a micro-batch's balanced layout (8 chunks per rank, median).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import header, refuse_existing, time_it, write_new
from zaya.model.masks import DocumentLayout
from zaya.parallel.context import SequenceLayout
from zaya.parallel.document_balance import chunk_work, greedy, imbalance, rank_work

SHAPES = ((32768, 2), (32768, 4), (32768, 8), (131072, 8))
MIXES = ("mean512", "mean2k", "mean8k", "sft", "one")
CHUNKS = (4, 8, 16)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """n lengths >= 1 of a lognormal law of mean `mean` (mu = ln(mean) - sigma^2 / 2)."""
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n).astype(np.int64))


def _documents(rng: np.random.Generator, mix: str, n: int) -> np.ndarray:
    """n document lengths of the mix."""
    if mix.startswith("mean"):
        return _lognormal(rng, {"mean512": 512, "mean2k": 2048, "mean8k": 8192}[mix], 1.0, n)
    turns = rng.geometric(0.5, n)
    total = turns.sum()
    lengths = _lognormal(rng, 120, 1.0, total) + _lognormal(rng, 400, 1.0, total)
    return np.add.reduceat(lengths, np.concatenate(([0], np.cumsum(turns)[:-1])))


def rows(rng: np.random.Generator, mix: str, length: int, count: int) -> list[tuple[int, ...]]:
    """The document starts of `count` rows of `length` tokens cut one after another from the mix's stream."""
    if mix == "one":
        return [(0,)] * count
    tokens = length * count
    bounds = np.zeros(1, dtype=np.int64)
    while bounds[-1] < tokens:  # document boundaries in the stream, to past its end
        bounds = np.concatenate((bounds, bounds[-1] + np.cumsum(_documents(rng, mix, tokens // 256 + 64))))
    out = []
    for r in range(count):
        inside = bounds[(bounds > r * length) & (bounds < (r + 1) * length)] - r * length
        out.append((0, *inside.tolist()))
    return out


def imbalances(starts: list[tuple[int, ...]], length: int, ranks: int, batch: int) -> dict[str, list[float]]:
    """Busiest over mean rank per micro-batch of `batch` rows, for head-tail and each chunk count."""
    out: dict[str, list[float]] = {"headtail": [], "greedy K8": [], **{f"K{k}": [] for k in CHUNKS}}
    headtail = tuple((r, 2 * ranks - 1 - r) for r in range(ranks))
    for i in range(0, len(starts) - batch + 1, batch):
        documents = DocumentLayout(tuple(starts[i:i + batch]), length)
        out["headtail"].append(imbalance(rank_work(chunk_work(documents, 2 * ranks), headtail)))
        work = chunk_work(documents, 8 * ranks)
        out["greedy K8"].append(imbalance(rank_work(work, greedy(work, ranks))))
        for k in CHUNKS:
            layout = SequenceLayout.balanced(length, ranks, documents, k)
            out[f"K{k}"].append(imbalance(rank_work(chunk_work(documents, ranks * k), layout.assignment)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200, help="sampled rows per mix and shape")
    parser.add_argument("--batch", type=int, default=4, help="rows of a micro-batch planned together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    refuse_existing(args.json)
    header(f"attention work per cp rank with packed documents, head-tail vs dealt out by work, {args.rows} rows "
           f"per mix, micro-batches of {args.batch}")
    started = time.perf_counter()
    results = []
    columns = ("headtail", "greedy K8", *(f"K{k}" for k in CHUNKS))
    print("busiest / mean rank's query-key pairs, median / p90 (K: chunks per rank, dealt out by work: greedy, "
          "then swaps; greedy K8: without the swaps)")
    print(f"{'tokens':>7} {'cp':>3} {'mix':>8} {'rows':>5} " + " ".join(f"{c:>13}" for c in columns)
          + f" {'plan ms':>8}")
    for length, ranks in SHAPES:
        for mix in MIXES:
            rng = np.random.default_rng([args.seed, length, ranks, MIXES.index(mix)])
            starts = rows(rng, mix, length, args.rows)
            plan = DocumentLayout(tuple(starts[:args.batch]), length)
            plan_ms = 1e3 * time_it(lambda n=length, r=ranks, d=plan: SequenceLayout.balanced(n, r, d, 8), repeats=21,
                                    warmup=2)
            for batch in (1, args.batch):
                values = imbalances(starts, length, ranks, batch)
                summary = {c: (float(np.median(v)), float(np.quantile(v, 0.9))) for c, v in values.items()}
                results.append({"tokens": length, "cp": ranks, "mix": mix, "batch": batch, "plan_ms": plan_ms,
                                "imbalance": summary, "samples": len(values["headtail"])})
                cells = " ".join(f"{m:>6.3f}/{p:<6.3f}" for m, p in summary.values())
                timing = f"{plan_ms:8.3f}" if batch > 1 else ""
                print(f"{length:>7} {ranks:>3} {mix:>8} {batch:>5} {cells} {timing}")
    print(f"# {time.perf_counter() - started:.1f} s; plan ms: SequenceLayout.balanced of one micro-batch of "
          f"{args.batch} rows, 8 chunks per rank")
    if args.json:
        write_new(args.json, {"args": vars(args) | {"json": str(args.json)}, "results": results})


if __name__ == "__main__":
    main()
