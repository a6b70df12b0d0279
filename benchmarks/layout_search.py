"""The layout chosen at launch (`parallel.layout = "auto"`): what the search costs a launch, and what the shipped
config is predicted to do as launched.

    python benchmarks/layout_search.py [--gpus 1024 8192] [--device mi300x] [--config configs/zaya1-base.toml]
                                       [--repeats 3] [--json PATH]

For each GPU count: the wall-clock seconds of `zaya.plan.auto.choose` as every rank runs it at start-up (the
search of `zaya plan --search` within the keys the config gives, median of --repeats, in this process after one
warm-up), and of a relaunch that finds the choice kept in the cache directory (`LayoutCache`, a temporary one
here). Then the prediction (`zaya.plan.planner.plan_run`) of the config as launched, the chosen layout written
into it, beside the search's best (the two must be equal: the launch trains what the search ranked first) and
beside the peer: the layout the config named by hand before it used `auto` (`--hand`, ZAYA1-base's: FSDP2 over
every GPU with ZeRO-2, no expert parallelism, one 4k sequence per micro-batch, cp 8 for the long phases). The
speed-up is the hand layout's predicted hours over the launched one's.

The predictions come from the device's published figures (`zaya plan --devices`), not a measured run: they are
what the planner believes, which is what it chooses by. The timings are of this machine's CPU.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

HAND = ['parallel.layout="config"', "parallel.dp_replicate=1", "parallel.dp_shard=-1", 'parallel.sharding="zero2"',
        "parallel.ep=1", "train.micro_batch_size=1", 'train.activation_checkpointing="none"', "phases.2.cp=8",
        "phases.3.cp=8"]


def measure(config_path: Path, gpus: int, device_name: str, per_node: int, repeats: int, hand: list[str]) -> dict:
    from zaya.config import load_config
    from zaya.errors import ZayaError
    from zaya.plan.auto import Cluster, LayoutCache, choose
    from zaya.plan.devices import get_device
    from zaya.plan.planner import plan_run
    from zaya.plan.search import Constraints, search_layouts

    config = load_config(config_path)
    if config.parallel.layout != "auto":
        raise SystemExit(f"{config_path}: parallel.layout is {config.parallel.layout!r}, not \"auto\"")
    device = get_device(device_name)
    cluster = Cluster(gpus, min(per_node, gpus), device)
    run = config.resolve(gpus, "bf16")
    choose(config, run, cluster)  # warm-up: imports, the model's inventory and operator counts
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        choice = choose(config, run, cluster)
        seconds.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as cache:
        choose(config, run, cluster, cache=LayoutCache(Path(cache)))
        started = time.perf_counter()
        choose(config, run, cluster, cache=LayoutCache(Path(cache)))
        cached = time.perf_counter() - started
    ranked = search_layouts(run, cluster.gpus_per_node, device, constraints=Constraints.of_config(config, run))
    best = next(c for c in ranked if not c.reason)
    launched = plan_run(choice.config.resolve(gpus, "bf16"), device, None, cluster.gpus_per_node)
    try:
        peer = plan_run(load_config(config_path, hand).resolve(gpus, "bf16"), device, None, cluster.gpus_per_node)
        peer_row = {"step_s": peer.first.time.total, "mfu": peer.mfu, "hours": peer.hours, "fits": peer.fits,
                    "problems": peer.problems}
    except ZayaError as exc:
        peer_row = {"error": str(exc)}
    return {"gpus": gpus, "device": device_name, "layouts": len(ranked), "fitting": sum(not c.reason for c in ranked),
            "search_s": statistics.median(seconds), "search_runs_s": seconds, "cached_s": cached,
            "settings": choice.settings, "launched": {"step_s": launched.first.time.total, "mfu": launched.mfu,
                                                      "hours": launched.hours},
            "search_best": {"mfu": best.plan.mfu, "hours": best.hours}, "hand": peer_row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--device", default="mi300x")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "zaya1-base.toml")
    parser.add_argument("--hand", nargs="*", default=HAND, help="--set items of the peer: the hand-written layout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 1 or min(args.gpus) < 1 or args.gpus_per_node < 1:
        parser.error("--repeats, --gpus and --gpus-per-node must be at least 1")

    from common import header, ratio_line, refuse_existing

    refuse_existing(args.json)
    header(f"layout search at launch: {args.config.name} on {', '.join(map(str, args.gpus))} x {args.device} "
           f"({args.gpus_per_node} per node); median of {args.repeats} after 1 warm-up")
    rows = []
    for gpus in args.gpus:
        row = measure(args.config, gpus, args.device, args.gpus_per_node, args.repeats, args.hand)
        rows.append(row)
        launched, best, hand = row["launched"], row["search_best"], row["hand"]
        print(f"{gpus:>6} GPUs: {row['layouts']:,} layouts weighed ({row['fitting']:,} fit) in {row['search_s']:.2f} s "
              f"(a relaunch with the choice kept: {row['cached_s'] * 1e3:.1f} ms)")
        print(f"        as launched: {' '.join('--set ' + s for s in row['settings'])}")
        print(f"        predicted: step {launched['step_s']:.3f} s, MFU {launched['mfu']:.1%}, "
              f"{launched['hours']:,.0f} h (the search's best: MFU {best['mfu']:.1%}, {best['hours']:,.0f} h)")
        if "error" in hand:
            print(f"        the hand-written layout cannot run: {hand['error']}")
        else:
            print(f"        the hand-written layout: step {hand['step_s']:.3f} s, MFU {hand['mfu']:.1%}, "
                  f"{hand['hours']:,.0f} h{'' if hand['fits'] else ' (does NOT fit)'}")
            print("        " + ratio_line("run time, launched vs hand-written", launched["hours"], hand["hours"], "h",
                                          higher_is_better=False))
        if abs(launched["hours"] - best["hours"]) > 1e-9 * best["hours"]:
            sys.exit(f"{gpus} GPUs: the launched layout's prediction ({launched['hours']} h) is not the search's best "
                     f"({best['hours']} h)")
    if args.json is not None:
        from common import machine, write_new

        write_new(args.json, {"date": datetime.date.today().isoformat(), "machine": machine(),
                              "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
