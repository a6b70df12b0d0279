"""How short runs of a config written from the docs train and route: held-out loss and expert load at step 40 of
small models, by the key temperature at init (`model.temp_init`), the learning rate, the vectors' share of AdamW's
rate (`optim.vector_lr_ratio`) and the seed, each run on the same data in the same order, with the defaults for
everything else (the schedule included: no warmup).

    python benchmarks/expert_balance.py [--shapes micro mini mini16] [--temps 0 1] [--lrs 0.003] [--seeds 0]
                                        [--ratios 0.03] [--steps 40] [--seq 128] [--batch 8]

For each run: the held-out loss at the last step (8 batches) and the last training loss; the busiest expert's
load over the mean load of each step (the largest over the layers): its largest value in the first 20 steps, how
many of those steps were above the collapse ratio (3.0) and its largest value in the last 10 steps; the step at
which the rule before the averaged load (3.0 x in 20 steps in a row, per step) would have warned; and the rule
the trainer applies (`zaya.resilience.signals.CollapseWatch`: the load averaged over 20 steps): the largest
averaged busiest/mean from step 20 on, and the step of its warning, if any.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

from common import header
from trainer_overhead import make_dataset
from zaya.config import load_config
from zaya.config_toml import toml_value
from zaya.report.report import read_all_incidents
from zaya.resilience.policy import TrainingSettings
from zaya.resilience.signals import CollapseWatch
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

warnings.filterwarnings("ignore")

SHAPES = {
    "micro": {"preset": "micro", "vocab_size": 8192},  # 4 experts, d 128, 3 blocks
    "mini": {"preset": "mini", "vocab_size": 8192},  # 8 experts, d 256, 4 blocks
    "mini16": {"preset": "mini", "vocab_size": 8192, "num_experts": 16, "moe_intermediate_size": 64},
    "demo": {"preset": "tiny", "hidden_size": 192, "head_dim": 24, "num_experts": 4},  # configs/tiny.toml's
    "tiny": {"preset": "tiny"},  # 8 experts, d 256, 4 blocks, experts of width 256
}
SETTINGS = TrainingSettings()


def run(root: Path, data: Path, args: argparse.Namespace, shape: str, temp: float, lr: float, ratio: float,
        seed: int) -> dict:
    name = f"{shape}-temp{temp:g}-lr{lr:g}-ratio{ratio:g}-seed{seed}"
    sections = {
        "model": {**SHAPES[shape], "temp_init": temp},
        "data": {"path": str(data), "seq_len": args.seq},
        "train": {"seed": seed, "max_steps": args.steps, "micro_batch_size": args.batch,
                  "global_batch_size": args.batch, "precision": "fp32", "eval_every": args.steps, "eval_batches": 8},
        "optim": {"lr": lr, "vector_lr_ratio": ratio, "ns_dtype": "float32"},
        "checkpoint": {"every": 100000},
        "logging": {"log_every": 1, "progress": False, "tensorboard": False},
    }
    config = root / f"{name}.toml"
    config.write_text("\n".join(f"[{section}]\n" + "".join(f"{key} = {toml_value(value)}\n"
                                                            for key, value in table.items())
                                 for section, table in sections.items()))
    start = time.perf_counter()
    build_trainer(load_config(config), root / name).run()
    seconds = time.perf_counter() - start
    rows = read_metrics(root / name)
    loads = [max(row["expert_imbalance"]) for row in rows]
    watch, averaged = CollapseWatch(SETTINGS), []
    for row in rows:
        watch.check(row["step"], row["expert_load"])
        if row["step"] >= SETTINGS.collapse_steps:
            averaged.append(max(watch.imbalance()))
    warned = [i["step"] for i in read_all_incidents(root / name) if i["signal"] == "expert_collapse"]
    return {"name": name, "eval": rows[-1]["eval_loss"], "loss": rows[-1]["loss"], "loads": loads,
            "per_step_rule": _per_step_rule(rows), "averaged": max(averaged, default=float("nan")),
            "warned": warned[0] if warned else None, "seconds": seconds}


def _per_step_rule(rows: list[dict]) -> int | None:
    """The step at which the rule before the averaged load warned: some layer above the ratio in `collapse_steps`
    steps in a row."""
    in_row = [0] * len(rows[0]["expert_imbalance"])
    for row in rows:
        in_row = [count + 1 if ratio > SETTINGS.collapse_ratio else 0
                  for count, ratio in zip(in_row, row["expert_imbalance"], strict=True)]
        if max(in_row) >= SETTINGS.collapse_steps:
            return row["step"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shapes", nargs="+", default=["micro", "mini", "mini16"], choices=list(SHAPES))
    parser.add_argument("--temps", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.003])
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.03])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    args = parser.parse_args()
    header(f"short runs: {args.steps} steps of {args.batch} x {args.seq} tokens")
    with tempfile.TemporaryDirectory(prefix="zaya-balance-") as tmp:
        root = Path(tmp)
        data = make_dataset(root, vocab_size=8192)
        for shape in args.shapes:
            for lr in args.lrs:
                for ratio in args.ratios:
                    for temp in args.temps:
                        for seed in args.seeds:
                            r = run(root, data, args, shape, temp, lr, ratio, seed)
                            loads, early = r["loads"], r["loads"][:SETTINGS.collapse_steps]
                            above = sum(load > SETTINGS.collapse_ratio for load in early)
                            print(f"{r['name']:<36} held-out {r['eval']:.3f}  loss {r['loss']:.3f}  busiest/mean per "
                                  f"step: first {len(early)} max {max(early):.1f} ({above} above "
                                  f"{SETTINGS.collapse_ratio:g}), last 10 max {max(loads[-10:]):.2f}; per-step rule: "
                                  f"{r['per_step_rule'] or 'none'}; averaged: max {r['averaged']:.2f}, warning "
                                  f"{r['warned'] or 'none'}  ({r['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
