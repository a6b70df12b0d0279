"""What computing the LM head in bf16 does to the loss: the same run twice, under bf16 autocast, once with the
tied head's matmuls in fp32 (`fp32_logits = true`, ZAYA1's `zaya_high_prec`) and once in bf16 (the softmax and
the loss stay fp32 either way), same seed, same data, same order; then both held-out losses over the same
windows. Accelerator configs (`configs/zaya1-base.toml`) take the bf16 head: it is 37% of ZAYA1-base's
training FLOPs at a 262k vocabulary, and bf16 matmuls run 8x (MI300X) to 15x (H100/H200) faster than fp32.

    python benchmarks/bf16_head.py [--preset micro] [--steps 200] [--seq 128] [--batch 8]

Newton-Schulz runs in fp32 in both runs (`optim.ns_dtype`): only the head differs. The defaults are small
because CPUs without native bf16 instructions emulate bf16 matmuls, 50-100x slower than fp32; with them (or
on a GPU) raise `--preset` and `--steps`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

from common import header
from trainer_overhead import make_dataset
from zaya.config import load_config
from zaya.model.presets import get_preset
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

warnings.filterwarnings("ignore")


def run(root: Path, data: Path, args: argparse.Namespace, fp32_logits: bool) -> dict:
    name = "fp32-head" if fp32_logits else "bf16-head"
    config = root / f"{name}.toml"
    config.write_text(f"""
[model]
preset = "{args.preset}"
fp32_logits = {str(fp32_logits).lower()}
[data]
path = "{data}"
seq_len = {args.seq}
[train]
seed = {args.seed}
max_steps = {args.steps}
micro_batch_size = {args.batch}
global_batch_size = {args.batch}
precision = "bf16"
compile = false
eval_every = {args.steps}
eval_batches = {args.eval_batches}
[optim]
lr = {args.lr}
ns_dtype = "float32"
[schedule]
warmup_steps = {max(1, args.steps // 20)}
[checkpoint]
every = {args.steps}
[logging]
log_every = {max(1, args.steps // 10)}
tensorboard = false
progress = false
""", encoding="utf-8")
    started = time.perf_counter()
    trainer = build_trainer(load_config(config), root / name)
    trainer.run()
    seconds = time.perf_counter() - started
    rows = read_metrics(root / name)
    evals = [row for row in rows if "eval_loss" in row]
    losses = [row["loss"] for row in rows if "loss" in row]
    return {"head": name, "train_loss_last": losses[-1], "eval_loss": evals[-1]["eval_loss"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=7, help="the model's initialisation and the data order")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    header(f"bf16 LM head against fp32: {args.preset}, {args.steps} steps of {args.batch} x {args.seq}, bf16 autocast, "
           f"seed {args.seed}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_dataset(root, min(8192, get_preset(args.preset).vocab_size))
        results = [run(root, data, args, fp32_logits) for fp32_logits in (True, False)]
    for r in results:
        print(f"{r['head']:<10} held-out loss {r['eval_loss']:.4f}   last train loss {r['train_loss_last']:.4f}   "
              f"{r['seconds']:.0f} s")
    fp32, bf16 = results
    delta = bf16["eval_loss"] - fp32["eval_loss"]
    print(f"held-out loss, bf16 head - fp32 head: {delta:+.4f} ({delta / fp32['eval_loss']:+.2%})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
