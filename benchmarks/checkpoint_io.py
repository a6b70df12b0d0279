"""Checkpoint I/O: save throughput against a plain fsync'd sequential write of the same bytes, how long an
asynchronous save blocks training against a synchronous one, and the time from process start to the first
resumed step with a cold and with a pre-warmed page cache.

The state is a real training state (model, Muon/AdamW moments, controller) of the chosen preset. Run:

    python benchmarks/checkpoint_io.py [--preset small] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch.distributed as dist

from common import header
from trainer_overhead import make_dataset
from zaya.checkpoint.files import drop_from_page_cache, prewarm
from zaya.config import load_config
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer

warnings.filterwarnings("ignore")


def config_text(data: Path, preset: str, steps: int, async_save: bool, precision: str = "bf16") -> str:
    return f"""
[model]
preset = "{preset}"
temp_init = 1.0
[data]
path = "{data}"
seq_len = 64
[train]
max_steps = {steps}
micro_batch_size = 2
global_batch_size = 2
precision = "{precision}"
eval_every = 0
[optim]
ns_dtype = "{"float32" if precision == "fp32" else "bfloat16"}"
[checkpoint]
every = 1000000
keep = 100
async_save = {"true" if async_save else "false"}
[logging]
tensorboard = false
progress = false
"""


def plain_write(directory: Path, total_bytes: int) -> float:
    """Seconds to write `total_bytes` sequentially in 8 MiB blocks and fsync: the disk's own pace."""
    block = os.urandom(8 << 20)
    path = directory / "plain.bin"
    start = time.perf_counter()
    with path.open("wb") as handle:
        written = 0
        while written < total_bytes:
            handle.write(block[: min(len(block), total_bytes - written)])
            written += len(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                        help="of the training step that makes the state (fp32 where bf16 matmuls are emulated)")
    args = parser.parse_args()
    header(f"checkpoint I/O, preset {args.preset} training state")
    # a process group of our own, so that the trainer leaves it (and its sharded state) usable after run()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp)
        data = make_dataset(root)
        (root / "run.toml").write_text(config_text(data, args.preset, 1, async_save=False, precision=args.precision))
        trainer = build_trainer(load_config(root / "run.toml"), root / "run")
        trainer.run()  # one step: optimizer moments exist
        newest = trainer.manager.committed()[-1]
        total = sum(p.stat().st_size for p in newest.iterdir() if p.is_file())
        # interleaved, so that the page cache's writeback state weighs on every variant alike
        plain_times, sync_times, async_blocked = [], [], []
        for _ in range(args.repeats):
            plain_times.append(plain_write(root, total))
            for async_save, bucket in ((False, sync_times), (True, async_blocked)):
                trainer.config.checkpoint.async_save = async_save
                trainer.progress.step += 1
                start = time.perf_counter()
                trainer.save()
                bucket.append(time.perf_counter() - start)  # what the training loop waits for
                trainer.manager.wait()
        newest = trainer.manager.committed()[-1]
        plain = statistics.median(plain_times)
        sync = statistics.median(sync_times)
        blocked = statistics.median(async_blocked)
        mb = total / 1e6
        print(f"checkpoint size: {mb:,.1f} MB in {sum(1 for _ in newest.iterdir())} files; "
              f"median of {args.repeats} interleaved runs")
        print(f"{'save throughput (MB/s)':<44} ours {mb / sync:10.1f}   plain fsync'd write {mb / plain:10.1f}   "
              f"ratio {plain / sync:.2f}x (target >= 0.5x)")
        print(f"{'time a step is blocked by a save (s)':<44} async {blocked:10.3f}   sync {sync:10.3f}   "
              f"share {blocked / sync:.1%} (target <= 20%)")

        # restart: a fresh process resumes from the newest checkpoint and runs one step
        steps = trainer.progress.step + 1
        (root / "run.toml").write_text(config_text(data, args.preset, steps, async_save=False,
                                                   precision=args.precision))
        for label in ("cold page cache", "warm page cache"):
            if label.startswith("cold"):
                drop_from_page_cache(newest)
            else:
                prewarm(newest)
                time.sleep(1.0)
            start = time.time()
            result = subprocess.run([sys.executable, "-m", "zaya.cli", "train", str(root / "run.toml"),
                                     "--run-dir", str(root / "run")], capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(result.stderr)
            first = next(row for row in read_metrics(root / "run") if row["step"] == steps)
            print(f"{'process start -> first resumed step (s)':<44} {label}: {first['time'] - start:7.2f}")
            # roll the run back so that the next restart resumes from the same checkpoint
            for extra in trainer.manager.committed():
                if extra.name > newest.name:
                    shutil.rmtree(extra)
            (root / "run" / "checkpoints" / "latest").write_text(newest.name + "\n")


if __name__ == "__main__":
    main()
