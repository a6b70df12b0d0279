"""Decoding over a sequence-sharded KV cache on gloo ranks of this machine: Tree Attention against the ring
pass, per-token latency and bytes sent, over the same cache on the same ranks.

    python benchmarks/tree_decode.py [--ranks 2 4] [--context 4096 8192 16384 32768] [--steps 10]
                                     [--layers 2] [--json PATH]

Each rank count runs in that many fresh processes (one intra-op thread each) on loopback. The model has
ZAYA1's attention shape (8 query heads over 2 KV heads of 128 dims, both convolutions, the value shift) on a
hidden size of 1024 (ZAYA1: 2048), `--layers` blocks, a small MoE (4 experts of width 512) and vocabulary
(512): the work per token besides attention, which is the same for both kernels, stays small; fp32, batch 1.

The context is not prefilled (a 32k-token prefill takes CCA's quadratic attention, minutes on a CPU): each
rank's shard of N tokens (N / ranks, the contiguous layout a sharded prefill leaves) is filled with random keys
of CCA's post-norm length sqrt(d) and random values, the last rank gets random convolution and value-shift
states, and `ShardedDecoder.attach` takes them. A decode query attends to every cached key without a mask, so
what the keys are does not change the work or the traffic. Both kernels then decode the same tokens from
identical caches, interleaved step by step (their logits are compared, as a check); a step is the whole
token: embedding, every block (the owner's projection, the query's broadcast, the attention and its
reduction, the MoE), the LM head. The processes keep freed memory (`zaya.device.tune_host_allocator`, as
training does), so that the ring's shard-sized buffers are not page-faulted in afresh at every hop. Printed
per (ranks, context): the median over --steps of the slowest rank's step time, and the bytes sent per token
per rank (mean over ranks, counted at the collectives as `zaya.parallel.comm` counts them); first, gloo's
latency here for one all-reduce and one broadcast of the sizes a tree step sends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from common import header, machine, run_ranks

KERNELS = ("tree", "ring")


def _config(layers: int):
    from zaya.model.presets import get_preset

    return get_preset("zaya1-8b", hidden_size=1024, num_hidden_layers=layers, num_experts=4, moe_intermediate_size=512,
                      router_hidden_size=64, vocab_size=512, temp_init=1.0)


def _filled_cache(model, context: int, rank: int, world: int, seed: int):
    """This rank's shard of a `context`-token cache: random post-norm keys and values, and on the last rank
    random convolution and value-shift states."""
    config = model.config
    cache = model.new_cache()
    length = context // world
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    Hk, d = config.num_key_value_heads, config.head_dim
    for layer in cache.layers:
        keys = torch.randn(1, Hk, length, d, generator=generator)
        keys *= math.sqrt(d) / keys.norm(dim=-1, keepdim=True)
        layer.append(keys, torch.randn(1, Hk, length, d, generator=generator))
        if rank == world - 1:
            layer.conv_state = torch.randn(1, config.conv_padding, config.conv_channels, generator=generator)
            layer.value_state = torch.randn(1, 1, config.key_latent // 2, generator=generator)
    return cache


def _latencies(config, repeats: int = 100) -> dict[str, float]:
    """Seconds per collective of the sizes one tree step sends per layer: the floor under its latency here."""
    import torch.distributed as dist

    Hq, d = config.num_attention_heads, config.head_dim
    packed, query = torch.zeros(1, Hq, 1, d + 1), torch.zeros(1, Hq, 1, d)
    seconds = {}
    for name, op in (("all_reduce", lambda: dist.all_reduce(packed)),
                     ("broadcast", lambda: dist.broadcast(query, src=dist.get_world_size() - 1))):
        for _ in range(10):
            op()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            op()
        seconds[name] = (time.perf_counter() - started) / repeats
    return seconds


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import zaya
    from zaya.device import tune_host_allocator
    from zaya.infer.tree import ShardedDecoder
    from zaya.parallel.comm import CommCounter

    # the ring allocates two shard-sized buffers per layer and hop; without this glibc maps each one afresh
    tune_host_allocator()
    dist.init_process_group("gloo")
    model = zaya.build_model(_config(args.layers), seed=0).eval()
    tokens = torch.randint(0, model.config.vocab_size, (args.warmup + args.steps,),
                           generator=torch.Generator().manual_seed(0))
    results: dict = {"collectives": _latencies(model.config), "contexts": []}
    for context in args.context:
        decoders = {}
        for kernel in KERNELS:  # identical caches: the same seed
            decoders[kernel] = ShardedDecoder(model, kernel=kernel, counter=CommCounter())
            decoders[kernel].attach(_filled_cache(model, context, rank, world, seed=context), context)
        times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
        sent: dict[str, list[int]] = {kernel: [] for kernel in KERNELS}
        worst = 0.0
        for i, token in enumerate(tokens):
            logits = {}
            for kernel, decoder in decoders.items():
                dist.barrier()
                started = time.perf_counter()
                logits[kernel] = decoder.step(token.view(1))
                elapsed = time.perf_counter() - started
                counted = decoder.counter.take()
                if i >= args.warmup:  # the first step doubles the owner's cache buffer; keep it out
                    times[kernel].append(elapsed)
                    sent[kernel].append(sum(counted.values()))
            worst = max(worst, (logits["tree"] - logits["ring"]).abs().max().item())
        results["contexts"].append({"context": context, "times": times, "sent": sent, "tree_vs_ring": worst})
        del decoders
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    import gc

    gc.collect()
    dist.destroy_process_group()


def summarise(world: int, results: list[dict]) -> list[dict]:
    """One row per context: the slowest rank's step time (median over steps) and the mean bytes per rank."""
    rows = []
    ranks = [r["contexts"] for r in results]
    for i, context in enumerate(r["context"] for r in ranks[0]):
        row: dict = {"ranks": world, "context": context,
                     "tree_vs_ring_max_abs_logit_diff": max(r[i]["tree_vs_ring"] for r in ranks)}
        for kernel in KERNELS:
            steps = zip(*(r[i]["times"][kernel] for r in ranks), strict=True)
            row[f"{kernel}_ms"] = 1e3 * statistics.median(max(step) for step in steps)
            row[f"{kernel}_bytes"] = statistics.mean(b for r in ranks for b in r[i]["sent"][kernel])
        rows.append(row)
    return rows


def _size(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per kernel and context")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    config = _config(args.layers)
    header(f"sharded-KV decoding, tree attention vs ring pass, {args.layers} blocks with ZAYA1's attention "
           f"({config.num_attention_heads} q heads, {config.num_key_value_heads} kv heads, head_dim "
           f"{config.head_dim}, hidden {config.hidden_size}), fp32, batch 1, gloo on loopback, one thread per "
           f"rank, {os.cpu_count()} cores; KV caches filled with random keys/values (see the docstring)")
    rows, floors = [], {}
    for world in args.ranks:
        ranks = run_ranks(_rank, world, args)
        floors[world] = {name: max(r["collectives"][name] for r in ranks) for name in ranks[0]["collectives"]}
        rows += summarise(world, ranks)
    packed = _size(4 * config.num_attention_heads * (config.head_dim + 1))
    for world, floor in floors.items():
        print(f"# {world} ranks: one all-reduce of the tree's {packed} "
              f"takes {1e3 * floor['all_reduce']:.2f} ms here, one broadcast of the query "
              f"{1e3 * floor['broadcast']:.2f} ms (a tree step: 2 all-reduces and 1 broadcast per layer)")
    print("| ranks | context | tree ms/token | ring ms/token | ring / tree | tree bytes/token/rank | "
          "ring bytes/token/rank | max |logit diff| |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['context'] // 1024}k | {row['tree_ms']:.2f} | {row['ring_ms']:.2f} | "
              f"{row['ring_ms'] / row['tree_ms']:.2f}x | {_size(row['tree_bytes'])} | {_size(row['ring_bytes'])} | "
              f"{row['tree_vs_ring_max_abs_logit_diff']:.1e} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine(),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "collective_seconds": floors, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
