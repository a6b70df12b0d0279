"""Steady-state step time of `zaya train` against a bare training loop on the same model and batches.

The bare loop is the least a step can do: take the next batch, forward + backward (under bf16 autocast by
default), clip, optimizer step, on the plain model. The trainer runs the model through `parallelize` (FSDP2
on a one-rank mesh, the code path of every world size: parameters gathered into their compute copies,
gradients reduced into the shards) and adds the batch ramp, phase bookkeeping, router statistics, the
step's statistics all-reduce, metrics (logged every step here, the worst case) and the progress bar.
Checkpoints and held-out evaluation are switched off for this measurement, and so is the balancing
controller: it changes which experts the tokens go to, and with them the work of the MoE layers, which is
not overhead. Run:

    python benchmarks/trainer_overhead.py [--preset tiny] [--steps 30] [--seq 256] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import torch

from common import header
from zaya.config import load_config
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.loader import TokenLoader
from zaya.model.transformer import Zaya
from zaya.optim.config import OptimConfig
from zaya.optim.hybrid import build_optimizer
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

warnings.filterwarnings("ignore")


def make_dataset(root: Path, vocab_size: int = 2048, **options) -> Path:
    """Python sources of some standard-library packages, built into a dataset under `root` (`options`: more
    `BuildOptions`)."""
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "asyncio", "collections", "importlib", "logging", "unittest"):
        for source in sorted((stdlib / package).glob("*.py")):
            (corpus / f"{package}_{source.stem}.txt").write_text(source.read_text(encoding="utf-8"))
    out = root / "data"
    build_dataset(BuildOptions(**{"inputs": (str(corpus),), "out": out, "vocab_size": vocab_size, "val_fraction": 0.05,
                                  **options}))
    return out


def write_config(path: Path, data: Path, args) -> Path:
    path.write_text(f"""
[model]
preset = "{args.preset}"
temp_init = 1.0
fp32_logits = false
[data]
path = "{data}"
seq_len = {args.seq}
[train]
max_steps = {args.steps}
micro_batch_size = {args.batch}
global_batch_size = {args.batch}
precision = "{args.precision}"
eval_every = 0
[optim]
lr = 0.003
ns_dtype = "{args.ns_dtype}"
[balance]
enabled = false
[checkpoint]
every = {args.steps * 10}
[logging]
log_every = 1
tensorboard = false
progress = true
""")
    return path


def bare_loop(config, data: Path, args) -> list[float]:
    torch.manual_seed(0)
    model = Zaya(config.model_config())
    optimizer = build_optimizer(model, OptimConfig(lr=0.003, ns_dtype=args.ns_dtype))
    loader = TokenLoader([(data, 1.0)], args.seq, seed=0)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        batch = loader.next_batch(args.batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    loader.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the steady state")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                        help="fp32 on CPUs without native bf16 matmuls, where bf16 runs emulated")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    header(f"trainer overhead, preset {args.preset}, batch {args.batch} x {args.seq}, {args.precision}, "
           f"Newton-Schulz in {args.ns_dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_dataset(root)
        config = load_config(write_config(root / "run.toml", data, args))
        build_trainer(config, root / "run").run()
        stamps = [row["time"] for row in read_metrics(root / "run")]
        trainer_step = (stamps[-1] - stamps[args.skip - 1]) / (len(stamps) - args.skip)
        bare = bare_loop(config, data, args)
        bare_step = statistics.mean(bare[args.skip:])
    overhead = trainer_step / bare_step - 1
    print(f"{'seconds per step (steady state)':<44} trainer {trainer_step:8.4f}   bare loop {bare_step:8.4f}   "
          f"overhead {overhead:+.1%} (target <= +5%)")


if __name__ == "__main__":
    main()
