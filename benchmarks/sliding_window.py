"""The cost of a sliding-window block against a full-attention block: forward + backward time and peak memory of
one ZAYA block at growing T, and the decode cache's bytes per layer as a generation grows.

    python benchmarks/sliding_window.py [--seq 4096 16384 32768] [--window 1024] [--part block|attention]
                                        [--repeats 3] [--json PATH]
    python benchmarks/sliding_window.py --quick        # smoke run: T = 1k, 2k, 4k, W = 256, one repeat

Training cost. One `ZayaBlock` (block index 0: attention, then MoE) of a moderate width (--hidden 512, --heads 4
query heads over --kv-heads 2 of --head-dim 64, --experts 4 of --expert-width 512; fp32, batch 1), built twice
from the same seed: with `layer_types = ["hybrid_sliding"]` and `sliding_window` W, and with `["hybrid"]`. The
two have the same weights (the parent checks a checksum of them); only the attention's reach and the RoPE of
its type differ. The sliding block runs as the model runs it on rows without packed documents: its plan is
`zaya.model.masks.window_segments(T, W)`, passed as `band=` (query tiles of min(512, max(64, W)) tokens, each
over the W + tile - 1 keys its window reaches: 1.5 W at W = 1k); the full block runs SDPA's fused causal
kernel. A pass is a forward of a random stream h [1, T, D] (requiring its gradient, as inside a stack) and
`backward` of a random gradient: dh and every parameter's gradient. `--part attention` times the attention
sublayer alone (the RMSNorm'd stream through `CompressedConvAttention`), without the MoE's linear cost.

Each (kind, T) runs in a fresh process, which first runs a pass at 2 W tokens (code pages, thread pool, the
band's path) and then builds its inputs. Memory: the process's peak resident set (ru_maxrss) over its value
once the inputs are built (the peak is reset there through /proc/self/clear_refs), for one pass, with glibc
told to serve every allocation of 1 MiB or more by its own mmap, so that a freed tensor leaves the resident set
and the peak is the memory live at once (as `packed_attention.py` measures). Time: afterwards the process keeps
freed memory as training does (`zaya.device.tune_host_allocator`), runs one warm-up pass, and reports the
median of --repeats passes. The growth ratios compare each T with the one before it: linear cost grows as T
does (x4 from 4k to 16k, x2 from 16k to 32k); the full block's attention grows as T^2 (x16, x4).

Decode cache. A `micro` model with two blocks, ["hybrid_sliding", "hybrid"] and W = --decode-window (64),
prefills a 16-token prompt and generates greedily token by token with its eager cache (`model.new_cache()`,
`model(ids, cache)`); at each of --decode-lengths the bytes of each layer's keys and values storage are read
(`untyped_storage().nbytes()`): a sliding layer's ring of W slots stays flat past W, a full layer's grows (by
doubling). The convolution and value-shift states, a few vectors per layer of either kind, are not counted.

A full run (4k, 16k, 32k; W 1k; 3 repeats) is estimated at about 5 minutes on 2 idle cores, most of it the
full block at 32k (five passes); on a shared machine several times that.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from pathlib import Path

KINDS = ("hybrid", "hybrid_sliding")
LABEL = {"hybrid": "full", "hybrid_sliding": "sliding"}


# ---- one case, in its own process -------------------------------------------------------------------------

def _config(spec: dict, kind: str):
    from zaya.model.config import ZayaConfig

    return ZayaConfig(vocab_size=256, hidden_size=spec["hidden"], num_hidden_layers=1,
                      num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                      head_dim=spec["head_dim"], num_experts=spec["experts"],
                      moe_intermediate_size=spec["expert_width"], router_hidden_size=64,
                      layer_types=[kind], sliding_window=spec["window"])


def _pass_fn(model, spec: dict, T: int):
    """One forward + backward of block 0 (or its attention sublayer) over a fresh random stream of T tokens."""
    import torch

    from zaya.model.masks import window_segments

    block = model.blocks[0]
    W = block.window
    ropes = model.rope(torch.arange(T))[block.layer_type]
    generator = torch.Generator().manual_seed(1)
    h = torch.randn(1, T, spec["hidden"], generator=generator).requires_grad_(True)
    grad = torch.randn(1, T, spec["hidden"], generator=generator)

    def step() -> None:
        band = window_segments(T, W) if W is not None and T > W else None  # as Zaya.hidden_states plans it
        if spec["part"] == "attention":
            out = block.attn(block.attn_norm(h), ropes, band=band)
        else:
            out, _, _ = block(h, None, ropes, band=band)
        out.backward(grad)
        h.grad = None
        for parameter in block.parameters():
            parameter.grad = None

    return step


def run_case(spec: dict) -> dict:
    """Measure one (kind, T) case in this process: peak memory of one pass, then the median time."""
    from common import peak_and_time, serve_large_allocations_by_mmap

    fixed = serve_large_allocations_by_mmap()
    import torch

    from zaya.model.transformer import Zaya

    torch.manual_seed(spec["seed"])
    model = Zaya(_config(spec, spec["kind"]))
    checksum = float(sum(p.detach().double().sum() for p in model.blocks[0].parameters()))
    _pass_fn(model, spec, min(spec["seq"], 2 * spec["window"]))()
    step = _pass_fn(model, spec, spec["seq"])
    return {**spec, **peak_and_time(step, spec["repeats"]), "weights_checksum": checksum,
            "mmap_threshold_fixed": fixed}


def _child(spec: dict) -> dict:
    from common import run_case_process

    return run_case_process(__file__, spec)


def decode_cache(window: int, lengths: list[int], prompt: int = 16) -> list[dict]:
    """Each layer's key + value bytes (and positions held) at each of `lengths` tokens of a greedy generation
    by a `micro` model of a sliding and a full block."""
    import torch

    from zaya.model.presets import get_preset
    from zaya.model.transformer import Zaya

    torch.manual_seed(0)
    model = Zaya(get_preset("micro", num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"],
                            sliding_window=window)).eval()
    cache = model.new_cache()
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    with torch.inference_mode():
        while cache.length < max(lengths):
            logits = model(ids, cache)
            ids = logits[:, -1:].argmax(-1)
            if cache.length in lengths:
                row = {"length": cache.length}
                for i, (block, layer) in enumerate(zip(model.blocks, cache.layers, strict=True)):
                    name = LABEL[block.layer_type]
                    storage = layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                    row[f"{name}_bytes"] = storage
                    row[f"{name}_held"] = layer.stored
                    row[f"{name}_layer"] = i
                rows.append(row)
    return rows


# ---- the run ----------------------------------------------------------------------------------------------

def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def report(cases: dict[tuple[str, int], dict], seqs: list[int], decode: list[dict], window: int) -> dict:
    """Print the tables (markdown) and return the growth ratios."""
    print("| T | full s | sliding s | sliding / full time | full memory | sliding memory | sliding / full memory |")
    print("|---|---|---|---|---|---|---|")
    for T in seqs:
        full, slide = cases["hybrid", T], cases["hybrid_sliding", T]
        print(f"| {T:,} | {full['seconds']:.3f} | {slide['seconds']:.3f} | {slide['seconds'] / full['seconds']:.2f}x "
              f"| {_size(full['peak_bytes'])} | {_size(slide['peak_bytes'])} | "
              f"{slide['peak_bytes'] / full['peak_bytes']:.2f}x |")
    growth = []
    if len(seqs) > 1:
        print()
        print("| T from -> to | T grows | full time | sliding time | full memory | sliding memory |")
        print("|---|---|---|---|---|---|")
        for a, b in itertools.pairwise(seqs):
            row = {"from": a, "to": b, "T": b / a}
            for kind in KINDS:
                row[f"{LABEL[kind]}_time"] = cases[kind, b]["seconds"] / cases[kind, a]["seconds"]
                row[f"{LABEL[kind]}_memory"] = cases[kind, b]["peak_bytes"] / cases[kind, a]["peak_bytes"]
            growth.append(row)
            print(f"| {a:,} -> {b:,} | x{row['T']:g} | x{row['full_time']:.2f} | x{row['sliding_time']:.2f} | "
                  f"x{row['full_memory']:.2f} | x{row['sliding_memory']:.2f} |")
    print()
    print(f"| tokens | sliding layer (W = {window}): k + v bytes, positions held | full layer: k + v bytes, "
          "positions held |")
    print("|---|---|---|")
    for row in decode:
        print(f"| {row['length']:,} | {_kib(row['sliding_bytes'])}, {row['sliding_held']} | "
              f"{_kib(row['full_bytes'])}, {row['full_held']} |")
    past = [row["sliding_bytes"] for row in decode if row["length"] >= window]
    if past:
        print(f"# sliding layer past W: {'flat' if len(set(past)) == 1 else 'NOT FLAT'} "
              f"({', '.join(_kib(b) for b in past)})")
    return {"growth": growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens per row, T")
    parser.add_argument("--window", type=int, default=1024, help="the sliding block's window W")
    parser.add_argument("--part", choices=("block", "attention"), default="block",
                        help="time the whole block, or its attention sublayer alone")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--decode-window", type=int, default=64, help="W of the decode-cache model")
    parser.add_argument("--decode-lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--quick", action="store_true", help="smoke run: --seq 1024 2048 4096 --window 256 "
                                                             "--repeats 1")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    from common import parse_or_run_case

    args = parse_or_run_case(parser, run_case)
    if args is None:
        return
    if args.quick:
        args.seq, args.window, args.repeats = [1024, 2048, 4096], 256, 1
    args.seq = sorted(set(args.seq))
    if args.repeats < 1 or args.window < 1 or args.decode_window < 1 or min(args.seq) < 16 \
            or min(args.decode_lengths) <= 16:
        parser.error("--repeats and the windows must be at least 1, --seq at least 16, --decode-lengths over the "
                     "16-token prompt")

    from common import header, refuse_existing

    refuse_existing(args.json)
    header(f"sliding-window (W = {args.window}) vs full-attention {args.part}: hidden {args.hidden}, {args.heads} "
           f"q heads over {args.kv_heads} kv heads of {args.head_dim}, {args.experts} experts of "
           f"{args.expert_width}, batch 1, fp32, forward + backward, {os.cpu_count()} cores; median of "
           f"{args.repeats} after 1 warm-up; peak RSS over the inputs, one process a case")
    base = dict(window=args.window, part=args.part, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, experts=args.experts, expert_width=args.expert_width,
                repeats=args.repeats, seed=args.seed)
    cases = {}
    for T in args.seq:
        for kind in KINDS:
            cases[kind, T] = _child({**base, "kind": kind, "seq": T})
            print(f"# {LABEL[kind]:>7} T {T:>6,}: {cases[kind, T]['seconds']:.3f} s, "
                  f"{_size(cases[kind, T]['peak_bytes'])}", flush=True)
        if cases["hybrid", T]["weights_checksum"] != cases["hybrid_sliding", T]["weights_checksum"]:
            sys.exit("the sliding and the full block were built with different weights")
    decode = decode_cache(args.decode_window, sorted(set(args.decode_lengths)))
    print()
    result = report(cases, args.seq, decode, args.decode_window)
    rows = list(cases.values())
    if not all(row["mmap_threshold_fixed"] for row in rows):
        print("# note: glibc's mmap threshold could not be fixed here: peak memory includes heap fragmentation")
    if not all(row["peak_reset"] for row in rows):
        print("# note: the peak resident set could not be reset here: a transient while building the inputs "
              "may hide part of a pass's peak")
    if args.json is not None:
        from common import machine, write_new

        write_new(args.json, {"date": datetime.date.today().isoformat(), "machine": machine(),
                              "args": {k: str(v) for k, v in vars(args).items() if k != "case"}, "rows": rows,
                              **result, "decode": decode})


if __name__ == "__main__":
    main()
