"""Context-parallel CCA on gloo ranks of this machine: activation memory per rank at cp = 1, 2, 4 for one fixed
sequence, bytes sent against the keys' and values' theoretical volume, and the ring kernel against the
all-gather kernel.

    python benchmarks/context_parallel.py [--preset mini] [--seq 4096] [--cp 1 2 4] [--repeats 3]

Each cp size runs in cp fresh processes (one intra-op thread each), every rank holding the whole model and
its share of one sequence (head-tail sharding); cp = 1 is the unsharded model. One measured step is the
training loss's forward and backward (no optimizer: it does not depend on cp). Printed per cp and kernel:

- activation memory per rank: the bytes autograd saves for backward during the forward pass (each storage
  once, the parameters left out), against the cp = 1 figure / cp (target: within 15%);
- bytes each rank sent (keys/values, their gradients and the halos, counted at the collectives), against the
  theoretical volume: per layer, every rank must receive the (cp - 1) other shards of keys and values in
  forward and again in backward, and return (cp - 1) shards of their gradients (target <= 1.1);
- seconds per forward + backward, ring kernel against the all-gather kernel (median of --repeats).
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


def _saved_bytes(step, params) -> int:
    """Bytes autograd holds for backward once `step()` (a forward pass) returns: each storage once."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    return loss, sum(storages.values())


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, kernel: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import torch.distributed as dist

    import zaya
    from zaya.parallel.comm import CommCounter
    from zaya.parallel.context import ContextParallel, SequenceLayout

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = zaya.build_model(zaya.get_preset(args.preset, temp_init=1.0), seed=0)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    counter = CommCounter()
    cp = ContextParallel(SequenceLayout(args.seq, world), dist.group.WORLD, kernel, counter) if world > 1 else None

    def forward() -> torch.Tensor:
        if cp is None:
            return model.loss(inputs, targets)
        return model.loss(cp.shard(inputs), cp.shard(targets), sequence=cp, positions=cp.positions())

    times, sent = [], []
    activations = 0
    for repeat in range(args.repeats + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        started = time.perf_counter()
        loss, activations = _saved_bytes(forward, list(model.parameters()))
        loss.backward()
        elapsed = time.perf_counter() - started
        if repeat:  # the first pass warms the allocator and the kernels up
            times.append(elapsed)
            sent.append(counter.take())
        else:
            counter.take()
    # per layer: (cp - 1) shards of k and v in forward, again in backward, and (cp - 1) shards of their gradients
    local_tokens = args.seq // world
    kv_shard = 2 * config.num_key_value_heads * config.head_dim * local_tokens * 4
    theory = config.num_hidden_layers * 3 * (world - 1) * kv_shard
    Path(out, f"rank{rank}.json").write_text(json.dumps({"activations": activations, "times": times, "sent": sent,
                                                         "theory": theory, "work": cp.attention_work if cp else 0}))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, kernel: str, args: argparse.Namespace) -> list[dict]:
    return run_ranks(_rank, world, args, kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--seq", type=int, default=4096, help="tokens of the one sequence")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    header(f"context-parallel CCA, preset {args.preset}, one sequence of {args.seq} tokens, fp32, head-tail "
           f"sharding, gloo, {os.cpu_count()} cores")
    base = None
    seconds: dict[tuple[int, str], float] = {}
    print(f"{'cp':>3} {'kernel':>9} {'activations/rank MB':>20} {'vs cp=1 / cp':>13} {'sent/rank MB':>13} "
          f"{'theory MB':>10} {'sent/theory':>12} {'fwd+bwd s':>10} {'attention pairs/rank':>21}")
    for world in args.cp:
        for kernel in (["allgather", "ring"] if world > 1 else ["-"]):
            ranks = run(world, kernel if world > 1 else "allgather", args)
            memory = max(r["activations"] for r in ranks)
            base = memory if world == 1 else base
            sent = statistics.mean(sum(s.values()) for r in ranks for s in r["sent"])
            theory = ranks[0]["theory"]
            seconds[(world, kernel)] = statistics.median(t for r in ranks for t in r["times"])
            scale = f"{memory / (base / world):13.3f}" if base else f"{'-':>13}"
            ratio = f"{sent / theory:12.3f}" if theory else f"{'-':>12}"
            work = sorted({r["work"] // (args.repeats + 1) for r in ranks})  # per forward pass; one value: balanced
            print(f"{world:>3} {kernel:>9} {memory / 1e6:20.1f} {scale} {sent / 1e6:13.2f} {theory / 1e6:10.2f} "
                  f"{ratio} {seconds[(world, kernel)]:10.3f} {'/'.join(str(w) for w in work):>21}")
    for world in args.cp:
        if (world, "ring") in seconds:
            ring, gather = seconds[(world, "ring")], seconds[(world, "allgather")]
            print(f"cp = {world}: ring kernel {ring:.3f} s vs all-gather kernel {gather:.3f} s per forward + backward "
                  f"({gather / ring:.2f}x)")


if __name__ == "__main__":
    main()
