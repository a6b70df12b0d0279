"""Attention over packed documents on one device at ZAYA1's attention shape: forward + backward time and peak
memory of `zaya.model.packed_attention` against unmasked fused attention and against the dense-mask path it
replaced, side by side in one run.

    python benchmarks/packed_attention.py [--seq 8192 16384 32768] [--mean 512 4096] [--dtype fp32|bf16]
                                          [--repeats 3] [--json PATH]
    python benchmarks/packed_attention.py --quick       # smoke run: 2,048 tokens, mean 512, one repeat

Shape: 8 query heads over 2 KV heads of 128 dims (ZAYA1's), batch 1, inputs random normal, fp32 by default
(bf16 with --dtype bf16). A row of T tokens holds documents whose lengths are drawn lognormal with sigma 1 and
the given mean (mu = ln(mean) - 1/2, numpy's generator seeded with --seed, 0 by default), rounded, at least 1
token, until the row is full: the last document is cut by the row's end. Each document ends with a separator
token, and the attention's plan is made from the token row the way the trainer makes it.

The paths, each a forward and a backward (`out.backward(dout)`, gradients of q, k and v):

- unmasked: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, the fused kernel with nothing
  but causality, documents not kept apart: the peer the packed path must stay near in memory and beat in time;
- dense mask: the path zaya had before, a [B, 1, T, T] boolean mask (causal, inside each query's document) built
  from the positions in the forward and passed to the same SDPA call; skipped, with the memory its masks need,
  where that exceeds half of this machine's RAM (the bool mask plus SDPA's additive copy in the inputs' dtype);
- packed: `packed_attention` over `DocumentLayout.from_tokens(...).segments()`, planned on the host first (the
  planning time is printed apart, with the segments' work against T^2 / 2).

The unmasked path does not see documents, and the dense-mask path's cost does not depend on where they start
(the kernel reads the whole mask: a causal and a document mask timed the same at 4k): both run once per T, the
dense mask with the first --mean's documents; the packed path runs per (T, mean).

Each case runs in a fresh process, which first runs its path once on 512 tokens (code pages, thread pool) and
then builds its inputs. Memory: the process's peak resident set (ru_maxrss) over its value once the inputs are
built (the peak is reset there through /proc/self/clear_refs), for one forward + backward, with glibc told to
serve every allocation of 1 MiB or more by its own mmap (a fixed threshold), so that a freed tensor leaves the
resident set and the peak is the memory live at once, not heap fragmentation. Time: afterwards the process
keeps freed memory as training does (`zaya.device.tune_host_allocator`), runs one warm-up pass, and prints the
median of --repeats passes. A full run (8k, 16k, 32k; means 512 and 4k; fp32; 3 repeats) takes about half an
hour on 2 cores, most of it the 32k unmasked and dense-mask passes (about 100 s each).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
from pathlib import Path

import numpy as np

SEPARATOR = 0
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
DTYPES = {"fp32": 4, "bf16": 2}  # bytes per element
WARM_TOKENS = 512


def document_row(length: int, mean: float, seed: int) -> np.ndarray:
    """Token ids [1, length] of documents with lognormal lengths (sigma 1, the given mean), each ended by the
    separator, the last one cut by the row's end."""
    tokens = np.random.default_rng(seed + 1).integers(1, 1000, size=(1, length), dtype=np.int64)
    lengths = np.random.default_rng(seed)  # a generator of its own: a shorter row's documents begin a longer one's
    end = 0
    while True:
        end += max(1, round(float(lengths.lognormal(math.log(mean) - 0.5, 1.0))))
        if end > length:
            return tokens
        tokens[0, end - 1] = SEPARATOR


def dense_mask_bytes(length: int, dtype: str) -> int:
    """The dense-mask path's [T, T] masks (batch 1): the bool mask and SDPA's additive copy of it."""
    return length * length * (1 + DTYPES[dtype])


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _pass_fn(path: str, tokens: np.ndarray, dtype: str):
    """(one forward + backward, planning facts) for `path` over the row `tokens`, on fresh inputs."""
    import torch
    import torch.nn.functional as F

    from zaya.model.masks import DocumentLayout, segment_work
    from zaya.model.packed_attention import packed_attention

    T = tokens.shape[1]
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)

    def make(heads: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(1, heads, T, HEAD_DIM, generator=generator, dtype=torch_dtype).requires_grad_(grad)

    q, k, v, dout = make(HEADS), make(KV_HEADS), make(KV_HEADS), make(HEADS, grad=False)
    layout = DocumentLayout.from_tokens(tokens, SEPARATOR)
    positions = layout.positions()
    facts: dict = {"documents": len(layout.starts[0])}

    if path == "unmasked":
        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif path == "dense":
        def attend() -> torch.Tensor:  # as zaya's attention did before the segments: the mask built per forward
            t = torch.arange(T)
            first = t - positions
            mask = ((t[None, None, :] >= first[:, :, None]) & (t[None, None, :] <= t[None, :, None]))[:, None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        def plan() -> np.ndarray:
            return DocumentLayout.from_tokens(tokens, SEPARATOR).segments()

        times = []
        for _ in range(5):
            started = time.perf_counter()
            table = plan()
            times.append(time.perf_counter() - started)
        segments = torch.from_numpy(table)
        facts.update(plan_ms=1e3 * sorted(times)[2], segments=len(table),
                     work=segment_work(table, 1) / (T * T / 2), pairs=layout.pairs() / (T * T / 2))

        def attend() -> torch.Tensor:  # as the model does: first from the positions, on the device
            first = torch.arange(T) - positions
            return packed_attention(q, k, v, segments, first)

    def step() -> None:
        attend().backward(dout)
        q.grad = k.grad = v.grad = None

    return step, facts


def run_case(spec: dict) -> dict:
    """Measure one (path, T, mean) case in this process: peak memory of one pass, then the median time."""
    from common import peak_and_time, serve_large_allocations_by_mmap

    fixed = serve_large_allocations_by_mmap()
    import torch

    torch.manual_seed(0)
    T, mean, dtype = spec["seq"], spec["mean"], spec["dtype"]
    warm, _ = _pass_fn(spec["path"], document_row(WARM_TOKENS, mean, spec["seed"]), dtype)
    warm()
    step, facts = _pass_fn(spec["path"], document_row(T, mean, spec["seed"]), dtype)
    return {**spec, **facts, **peak_and_time(step, spec["repeats"]), "mmap_threshold_fixed": fixed}


def _child(spec: dict) -> dict:
    from common import run_case_process

    return run_case_process(__file__, spec)


# ---- the run ----------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768], help="tokens per row, T")
    parser.add_argument("--mean", type=int, nargs="+", default=[512, 4096], help="mean document lengths")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    parser.add_argument("--quick", action="store_true", help="smoke run: --seq 2048 --mean 512 --repeats 1")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    from common import parse_or_run_case

    args = parse_or_run_case(parser, run_case)
    if args is None:
        return
    if args.quick:
        args.seq, args.mean, args.repeats = [2048], [512], 1
    if args.repeats < 1 or min(args.seq) < 16 or min(args.mean) < 1:
        parser.error("--repeats and --mean must be at least 1, --seq at least 16")

    from common import header, refuse_existing

    refuse_existing(args.json)
    header(f"packed-document attention, {HEADS} q heads over {KV_HEADS} kv heads of {HEAD_DIM}, batch 1, "
           f"{args.dtype}, forward + backward, {os.cpu_count()} cores; documents lognormal (sigma 1, seed "
           f"{args.seed}); median of {args.repeats} after 1 warm-up; peak RSS over the inputs, one process a case")
    limit = _ram_bytes() // 2
    rows = []
    print("| T | documents | path | fwd+bwd s | peak memory | time / unmasked | memory / unmasked | "
          "work / (T^2/2) | plan ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.seq:
        base = dict(seq=T, dtype=args.dtype, repeats=args.repeats, seed=args.seed)
        peer = _child({**base, "path": "unmasked", "mean": args.mean[0]})
        peer["label"] = "unmasked (no documents)"
        cases = [peer]
        need = dense_mask_bytes(T, args.dtype)
        if need > limit:
            cases.append({**base, "path": "dense", "mean": args.mean[0], "skipped": True, "mask_bytes": need,
                          "label": f"dense mask, mean {args.mean[0]}"})
        else:
            cases.append({**_child({**base, "path": "dense", "mean": args.mean[0]}),
                          "label": f"dense mask, mean {args.mean[0]}"})
        for mean in args.mean:
            cases.append({**_child({**base, "path": "packed", "mean": mean}), "label": f"packed, mean {mean}"})
        for case in cases:
            rows.append(case)
            if case.get("skipped"):
                print(f"| {T // 1024}k | - | {case['label']} | skipped: its masks need {_gib(case['mask_bytes'])}, "
                      f"over half the RAM ({_gib(limit)}) | | | | | |")
                continue
            case["time_ratio"] = case["seconds"] / peer["seconds"]
            case["memory_ratio"] = case["peak_bytes"] / peer["peak_bytes"]
            work = f"{case['work']:.3f} (exact {case['pairs']:.3f}, {case['segments']} segments)" if "work" in case \
                else ("1.000 (causal)" if case["path"] == "unmasked" else "-")
            plan = f"{case['plan_ms']:.2f}" if "plan_ms" in case else "-"
            documents = "-" if case["path"] == "unmasked" else str(case["documents"])
            print(f"| {T // 1024}k | {documents} | {case['label']} | {case['seconds']:.3f} | "
                  f"{_gib(case['peak_bytes'])} | {case['time_ratio']:.2f}x | {case['memory_ratio']:.2f}x | {work} | "
                  f"{plan} |")
    print("# targets: packed memory <= 1.2x unmasked; packed time < 1x unmasked where documents are short")
    for row in rows:
        if row["path"] == "packed":
            print(f"T {row['seq']:>6}, mean {row['mean']:>5}: memory {row['memory_ratio']:.2f}x "
                  f"({'ok' if row['memory_ratio'] <= 1.2 else 'OVER 1.2x'}), time {row['time_ratio']:.2f}x "
                  f"of the unmasked fused kernel")
    if not all(row.get("mmap_threshold_fixed", True) for row in rows):
        print("# note: glibc's mmap threshold could not be fixed here: peak memory includes heap fragmentation")
    if not all(row.get("peak_reset", True) for row in rows):
        print("# note: the peak resident set could not be reset here: a transient while building the inputs "
              "may hide part of a pass's peak")
    if args.json is not None:
        from common import machine, write_new

        write_new(args.json, {"date": datetime.date.today().isoformat(), "machine": machine(),
                              "args": {k: str(v) for k, v in vars(args).items() if k != "case"}, "rows": rows})


if __name__ == "__main__":
    main()
