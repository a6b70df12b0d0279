"""Expert parallelism's token exchange on gloo ranks of this machine: how much of it the tokens that stay on a
rank hide, against the same layer waiting for each exchange where it starts.

    python benchmarks/ep_overlap.py [--preset small] [--tokens 4096] [--ep 2 4] [--repeats 7]

Each ep size runs in ep fresh processes (one intra-op thread each) holding one MoE layer's experts of the preset
(E / ep each), fp32, every rank routing its --tokens tokens uniformly over all E experts (so 1/ep of them stay).
One measured pass is the layer's forward and backward (`ParallelExperts`, eager), in two orders on the same
routes: `overlap` (the default: half the staying tokens run while the rows go out, half while the outputs come
back, and their backward while the gradients travel) and `serial` (each exchange waited for where it starts:
the order without overlap, the same work). Printed per ep and order, medians over the ranks and --repeats:

- seconds per forward + backward;
- exposed: seconds the rank spent waiting for its exchanges (blocked in `wait_tensor`: the four of the rows and
  the one of the counts), and that as a share of the serial order's waiting (the part the overlap did not hide);
- bytes each rank sent per pass (counted at the collective).

On a CPU the ranks' compute and gloo's copies share the same cores, so the exchange's own time is a copy
through the loopback, not a link running beside the compute as on GPUs: read the exposed share, not the speed.
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
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    import torch.distributed._functional_collectives as funcol

    import zaya
    from zaya.model.moe import Experts
    from zaya.parallel import experts as ep_module
    from zaya.parallel.comm import CommCounter
    from zaya.parallel.config import ParallelConfig
    from zaya.parallel.launch import Launch
    from zaya.parallel.mesh import init_parallel

    context = init_parallel(ParallelConfig(ep=world), torch.device("cpu"), Launch.from_env(os.environ))
    config = zaya.get_preset(args.preset)
    torch.manual_seed(0)
    whole = Experts(config)
    for param in (whole.gate_up_proj, whole.down_proj):
        torch.nn.init.normal_(param, std=config.hidden_size ** -0.5)
    generator = torch.Generator().manual_seed(rank)
    route = torch.randint(0, config.num_experts, (args.tokens,), generator=generator)
    x = torch.randn(args.tokens, config.hidden_size, generator=generator)

    # every wait for an exchange goes through this function (the counts' too, the same in both orders)
    waited = [0.0]
    wait_tensor = funcol.wait_tensor

    def timed_wait(tensor):
        started = time.perf_counter()
        try:
            return wait_tensor(tensor)
        finally:
            waited[0] += time.perf_counter() - started

    funcol.wait_tensor = timed_wait
    results = {}
    for order in ("overlap", "serial"):
        counter = CommCounter()
        layer = ep_module.ParallelExperts(whole, context.experts, counter, overlap=order == "overlap")
        times, exposed, sent = [], [], []
        for repeat in range(args.repeats + 1):
            layer.zero_grad(set_to_none=True)
            x_in = x.clone().requires_grad_()
            torch.distributed.barrier()
            waited[0] = 0.0
            started = time.perf_counter()
            layer(x_in, route, None).square().mean().backward()
            elapsed = time.perf_counter() - started
            if repeat:  # the first pass warms the allocator and the kernels up
                times.append(elapsed)
                exposed.append(waited[0])
                sent.append(counter.take().get(ep_module.KIND, 0))
            else:
                counter.take()
        results[order] = {"times": times, "exposed": exposed, "sent": sent}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import zaya

    config = zaya.get_preset(args.preset)
    header(f"expert-parallel token exchange, preset {args.preset} (E {config.num_experts}, D {config.hidden_size}, "
           f"F {config.moe_intermediate_size}), {args.tokens} tokens per rank, fp32, gloo, {os.cpu_count()} cores")
    print(f"{'ep':>3} {'order':>8} {'fwd+bwd s':>10} {'exposed s':>10} {'exposed share':>14} {'sent/rank MB':>13}")
    for world in args.ep:
        if config.num_experts % world:
            print(f"{world:>3} skipped: {config.num_experts} experts do not split over {world} ranks")
            continue
        ranks = run_ranks(_rank, world, args)
        medians = {order: {key: statistics.median(v for r in ranks for v in r[order][key])
                           for key in ("times", "exposed", "sent")} for order in ("overlap", "serial")}
        for order, m in medians.items():
            share = m["exposed"] / medians["serial"]["exposed"]
            print(f"{world:>3} {order:>8} {m['times']:10.4f} {m['exposed']:10.4f} {share:14.2f} "
                  f"{m['sent'] / 1e6:13.2f}")
        serial, overlap = medians["serial"]["times"], medians["overlap"]["times"]
        print(f"ep = {world}: overlap {overlap:.4f} s vs serial {serial:.4f} s per forward + backward "
              f"({serial / overlap:.2f}x)")


if __name__ == "__main__":
    main()
