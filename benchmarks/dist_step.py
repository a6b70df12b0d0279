"""Sharded training on gloo ranks of this machine: training state per rank, bytes on the wire against FSDP2's
theoretical volume, distributed Muon's extra traffic, and step time at 2 ranks against 1.

    python benchmarks/dist_step.py [--preset tiny] [--ranks 1 2 4] [--batch 4] [--seq 128] [--steps 4]
                                   [--micro-batches 1] [--shardings full zero2] [--precision fp32]
                                   [--ns-dtype float32] [--ep 1 2]

Each world size N runs in N fresh processes (one intra-op thread each, so that a rank has the same compute
at every N), through the trainer's own pieces: `init_parallel`, `parallelize`, `build_optimizer`. The batch per
rank is fixed (weak scaling). Printed per N, and as ratios against the named references:

- training state per rank: the local shards of parameters, gradients and optimizer state; against the
  one-rank figure / N (target: within 10%, beyond the replicated scalars such as AdamW's step counters);
- bytes each rank sent in one step, counted at the collectives as they are issued (`zaya.parallel.comm`),
  against FSDP2's theoretical volume (`fsdp_volume`: all-gathers in forward and backward, reduce-scatter of
  the gradients; target <= 1.1);
- distributed Muon's bytes against that volume, and the step's total against FSDP alone (Moonlight reports
  1-1.25x of AdamW's data-parallel traffic for its distributed Muon);
- seconds per step at N ranks against 1 rank;
- each sharding mode (`parallel.sharding`) side by side: with --micro-batches above 1, full sharding gathers
  and reduces in every micro-batch, ZeRO-2 once per step;
- with --ep above 1 (expert parallelism, `parallel.ep`, at every world size it divides), the bytes of the
  token exchange against the routes: each rank sends the rows it routes to the other ranks of its group and,
  in the combine, the rows they routed to it, once forward and once backward, plus the counts (theory from the
  routes each rank recorded, so the ratio is exact, not a uniform-routing estimate); FSDP2's bytes against
  `fsdp_volume(..., ep)`; and the step time against no expert parallelism at the same N;
- the owner plan's balance of Newton-Schulz FLOPs (busiest rank / mean) for the `small` and `zaya1-base`
  matrices on --plan-ranks ranks, computed from the shapes alone (meta device).

The defaults (fp32, fp32 Newton-Schulz) keep CPUs without native bf16 matmuls usable; `--precision bf16
--ns-dtype bfloat16` measures the production setting's bytes (bf16 all-gathers, bf16 results from Muon).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from common import header, run_ranks


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import zaya
    from zaya.model.transformer import Zaya
    from zaya.optim.config import OptimConfig
    from zaya.optim.hybrid import build_optimizer
    from zaya.parallel.config import ParallelConfig, ParallelizeConfig
    from zaya.parallel.dtensor import local, local_bytes
    from zaya.parallel.experts import parallel_experts, whole_shapes
    from zaya.parallel.fsdp import (
        accumulate,
        fsdp_volume,
        parallelize,
        reduce_and_clip,
        refresh,
        replicated_parameters,
    )
    from zaya.parallel.launch import Launch
    from zaya.parallel.materialize import materialize
    from zaya.parallel.mesh import init_parallel

    context = init_parallel(ParallelConfig(ep=args.ep), torch.device("cpu"), Launch.from_env(os.environ))
    mode = args.sharding
    sharding = ParallelizeConfig(bf16=args.precision == "bf16", sharding=mode)
    with torch.device("meta"):
        model = Zaya(zaya.get_preset(args.preset))
    model = parallelize(model, context.fsdp_mesh, sharding, context.counter, context.experts)
    model = materialize(model, torch.device("cpu"), 0, whole_shapes(model))
    routed = []  # per MoE layer call: the rows this rank routes to each rank of its expert group

    def note_routes(module, inputs) -> None:
        route = inputs[1]
        counts = torch.bincount(route, minlength=module.total + 1)[:module.total]
        routed.append(counts.view(args.ep, -1).sum(1).tolist())

    for experts in parallel_experts(model):
        experts.register_forward_pre_hook(note_routes)
    optimizer = build_optimizer(model, OptimConfig(ns_dtype=args.ns_dtype), comm=context.counter)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(rank)
    times, sent = [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for index, micro in enumerate(ids.chunk(args.micro_batches)):
            accumulate(model, mode, last=index == args.micro_batches - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = model.loss(micro[:, :-1], micro[:, 1:])
            (loss * micro.shape[0] / ids.shape[0]).backward()
        reduce_and_clip(model, [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None],
                        context, 1.0)
        forward_backward = context.counter.take()
        optimizer.step()
        muon = context.counter.take()
        refresh(model, mode)  # ZeRO-1's gathering after the update, counted with the next step's FSDP bytes
        if step:  # the first step builds the optimizer state and the owner plan
            times.append(time.perf_counter() - started)
            sent.append((forward_backward, muon))
        else:
            routed.clear()
    params = [p for group in optimizer.param_groups for p in group["params"]]  # the shards, in any mode
    routers = sum(p.numel() for p in replicated_parameters(model))
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    replicated = [t for t in state if local(t).numel() == t.numel() and t.dim() == 0]
    result = {
        "params": local_bytes(params), "grads": local_bytes([p.grad for p in params if p.grad is not None]),
        "state": local_bytes(state), "replicated": local_bytes(replicated),
        "times": times, "sent": sent, "routed": routed, "hidden": model.config.hidden_size,
        "experts": model.config.num_experts,
        # FSDP2's collectives and the routers' gradient all-reduce (they are whole on every rank)
        "theory": fsdp_volume(zaya.build_model(args.preset, seed=0), world, 1, args.precision, args.micro_batches,
                              sharding=mode, ep=args.ep) + 2 * routers * 4 * (world - 1) / world,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    import gc

    gc.collect()
    context.close()


def run(world: int, args: argparse.Namespace) -> list[dict]:
    return run_ranks(_rank, world, args)


def plan_balance(presets: list[str], worlds: list[int]) -> None:
    from zaya.model.presets import get_preset
    from zaya.model.transformer import Zaya
    from zaya.optim.distributed import MatrixLayout, plan_owners
    from zaya.optim.hybrid import split_parameters
    from zaya.parallel.fsdp import shard_dim

    for preset in presets:
        with torch.device("meta"):
            model = Zaya(get_preset(preset))
        params = [p for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params]
        cells = []
        for world in worlds:
            plan = plan_owners(tuple(MatrixLayout(tuple(p.shape), shard_dim(tuple(p.shape), world))
                                     for p in params), world)
            cells.append(f"{world}: {plan.imbalance:.3f}")
        print(f"Newton-Schulz FLOPs, busiest rank / mean, {preset:<11} " + "  ".join(cells) + "  (target <= 1.15)")


def exchange_theory(ranks: list[dict], ep: int, precision: str) -> list[float]:
    """Each rank's bytes of the token exchange over the measured steps, from the routes they recorded: per MoE
    layer call, the rows it sends to the others of its group and the rows they send it (the combine returns
    them), each of `hidden` values in the autocast dtype, forward and backward; and the counts, E / ep int64
    to each other rank."""
    width = ranks[0]["hidden"] * (2 if precision == "bf16" else 4)
    counts_bytes = (ep - 1) * ranks[0]["experts"] // ep * 8
    theory = []
    for rank, result in enumerate(ranks):
        group = [r for r in range(len(ranks)) if r // ep == rank // ep]
        mine, total = rank % ep, 0.0
        for call, routed in enumerate(result["routed"]):
            out = sum(n for p, n in enumerate(routed) if p != mine)
            into = sum(ranks[peer]["routed"][call][mine] for peer in group if peer != rank)
            total += 2 * (out + into) * width + counts_bytes
        theory.append(total)
    return theory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches each rank's batch is cut into")
    parser.add_argument("--shardings", nargs="+", default=["full"], choices=["full", "zero2", "zero1"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--plan-ranks", type=int, nargs="+", default=[2, 3, 4, 8, 32, 64])
    parser.add_argument("--ep", type=int, nargs="+", default=[1], help="expert-parallel sizes (parallel.ep)")
    args = parser.parse_args()
    if args.batch % args.micro_batches:
        parser.error(f"--batch {args.batch} does not split into --micro-batches {args.micro_batches}")
    header(f"sharded training, preset {args.preset}, {args.batch} x {args.seq} tokens per rank in "
           f"{args.micro_batches} micro-batch(es), {args.precision}, Newton-Schulz in {args.ns_dtype}, gloo, "
           f"{os.cpu_count()} cores")
    plan_balance(["small", "zaya1-base"], args.plan_ranks)
    for mode in args.shardings:
        print(f"-- {mode} sharding")
        report(argparse.Namespace(**{**vars(args), "sharding": mode, "ep": 1}))
    for ep in (e for e in args.ep if e > 1):
        for mode in args.shardings:
            print(f"-- expert parallelism, ep {ep}, {mode} sharding")
            report_ep(argparse.Namespace(**{**vars(args), "sharding": mode, "ep": ep}))


def report_ep(args: argparse.Namespace) -> None:
    print(f"{'ranks':>5} {'exchange MB':>12} {'theory MB':>10} {'measured/theory':>16} {'FSDP MB':>8} "
          f"{'FSDP theory MB':>15} {'measured/theory':>16} {'s/step':>7} {'s/step ep 1':>12} {'ep/ep 1':>8}")
    for world in (w for w in args.ranks if w % args.ep == 0):
        ranks = run(world, args)
        plain = run(world, argparse.Namespace(**{**vars(args), "ep": 1}))
        steps = len(ranks[0]["sent"])
        exchanged = statistics.mean(sum(s[0].get("experts", 0) for s in r["sent"]) / steps for r in ranks)
        theory = statistics.mean(exchange_theory(ranks, args.ep, args.precision)) / steps
        fsdp = statistics.mean(sum(v for k, v in s[0].items() if k.startswith("fsdp_") or k == "replicated")
                               for r in ranks for s in r["sent"])
        seconds = statistics.median(t for r in ranks for t in r["times"])
        base = statistics.median(t for r in plain for t in r["times"])
        print(f"{world:>5} {exchanged / 1e6:12.3f} {theory / 1e6:10.3f} {exchanged / theory:16.4f} "
              f"{fsdp / 1e6:8.2f} {ranks[0]['theory'] / 1e6:15.2f} {fsdp / ranks[0]['theory']:16.3f} "
              f"{seconds:7.3f} {base:12.3f} {base / seconds:8.2f}")


def report(args: argparse.Namespace) -> None:
    results = {world: run(world, args) for world in args.ranks}
    one = results.get(1)
    base = (one[0]["params"] + one[0]["grads"] + one[0]["state"] - one[0]["replicated"]) if one else None
    seconds = {}
    print(f"{'ranks':>5} {'state/rank MB':>14} {'vs 1-rank/N':>11} {'sent/rank MB':>13} {'FSDP theory MB':>15} "
          f"{'measured/theory':>16} {'Muon MB':>8} {'Muon/FSDP':>10} {'(FSDP+Muon)/FSDP':>17} {'s/step':>7}")
    for world, ranks in results.items():
        sharded = max(r["params"] + r["grads"] + r["state"] - r["replicated"] for r in ranks)
        fsdp = statistics.mean(sum(v for k, v in s[0].items() if k.startswith("fsdp_") or k == "replicated")
                               for r in ranks
                               for s in r["sent"])
        muon = statistics.mean(s[1].get("muon_gather", 0) + s[1].get("muon_scatter", 0) for r in ranks
                               for s in r["sent"])
        theory = ranks[0]["theory"]
        seconds[world] = statistics.median(t for r in ranks for t in r["times"])
        scale = f"{sharded / (base / world):11.3f}" if base else f"{'-':>11}"
        ratio = f"{fsdp / theory:16.3f}" if theory else f"{'-':>16}"
        extra = f"{muon / fsdp:10.3f} {(fsdp + muon) / fsdp:17.3f}" if fsdp else f"{'-':>10} {'-':>17}"
        print(f"{world:>5} {sharded / 1e6:14.2f} {scale} {fsdp / 1e6:13.2f} {theory / 1e6:15.2f} {ratio} "
              f"{muon / 1e6:8.2f} {extra} {seconds[world]:7.3f}")
    if 1 in seconds and 2 in seconds:
        print(f"step time, 2 ranks vs 1 rank (same batch per rank): {seconds[2]:.3f} s vs {seconds[1]:.3f} s, "
              f"{seconds[1] / seconds[2]:.2f}x the per-rank throughput of one rank")


if __name__ == "__main__":
    main()
