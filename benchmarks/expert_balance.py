"""Whether the routers keep their tokens spread at lr 0.01: the demo's model (`tiny` with d = 192 and 4 experts)
and the `tiny` preset (8 experts), each trained with the vectors (norms, biases, residual scales and biases, EDA
gammas, temperatures) at several fractions of AdamW's rate (`optim.vector_lr_ratio`; 1.0 is the recipe before
it, 0.03 the default), same seed, same data, same order, the default balancing gain.

    python benchmarks/expert_balance.py [--steps 40] [--seq 128] [--batch 16] [--ratios 1.0 0.1 0.03]

For each run: the last training loss, the busiest expert's load over the mean load (the largest over the
layers: 4.0 of 4 or 8.0 of 8 is every token on one expert) at every fifth step and over the last ten steps, and
the step at which the default collapse warning (3.0 x the mean in 20 steps in a row) fired, if it did.
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
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

warnings.filterwarnings("ignore")

SHAPES = {
    "demo": {"preset": "tiny", "hidden_size": 192, "head_dim": 24, "num_experts": 4},
    "tiny": {"preset": "tiny"},
}


def run(root: Path, data: Path, args: argparse.Namespace, shape: str, ratio: float) -> dict:
    name = f"{shape}-{ratio:g}"
    sections = {
        "model": {**SHAPES[shape], "temp_init": 1.0},
        "data": {"path": str(data), "seq_len": args.seq},
        "train": {"seed": 0, "max_steps": args.steps, "micro_batch_size": args.batch,
                  "global_batch_size": args.batch, "precision": "fp32", "eval_every": 0},
        "optim": {"lr": 0.01, "vector_lr_ratio": ratio, "ns_dtype": "float32"},
        "schedule": {"warmup_steps": 20},
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
    collapse = [i["step"] for i in read_all_incidents(root / name) if i["signal"] == "expert_collapse"]
    return {"name": name, "loss": rows[-1]["loss"], "loads": loads, "collapse": collapse[0] if collapse else None,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ratios", nargs="+", type=float, default=[1.0, 0.1, 0.03])
    args = parser.parse_args()
    header(f"expert balance at lr 0.01: {args.steps} steps of {args.batch} x {args.seq} tokens")
    with tempfile.TemporaryDirectory(prefix="zaya-balance-") as tmp:
        root = Path(tmp)
        data = make_dataset(root, vocab_size=8192)
        for shape in args.shapes:
            for ratio in args.ratios:
                result = run(root, data, args, shape, ratio)
                loads = result["loads"]
                every = " ".join(f"{load:.1f}" for load in loads[4::5])
                fired = f"collapse warned at step {result['collapse']}" if result["collapse"] else "no collapse warning"
                print(f"{result['name']:<10} loss {result['loss']:.3f}  busiest/mean every 5th step: {every}  "
                      f"last 10: max {max(loads[-10:]):.2f}  {fired}  ({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
