"""Training throughput after a checkpoint against before it, synchronous and async saves.

A save once left threads behind that cost every later step (docs/speed.md#after-a-checkpoint): DCP's collectives,
run even on one rank, copied their plans in gloo's threads with OpenMP teams of their own, and libgomp, managing
more threads than cores, stopped spin-waiting in the training thread's parallel regions. Each run here trains the
demo's model (`configs/tiny.toml`'s shape, fp32, 16 x 256 tokens a step, no batch ramp, no evaluation) in a
fresh process, with one checkpoint in the middle; the figure is the median tokens/s of the steps after it over the
median of the steps before it (the first steps after it are left out: an async save's writer shares the CPU
with them). Three runs each of sync and async saves, and of runs without a checkpoint there (the spread of
"after" over "before" in runs of the same work), interleaved; `--before-fix` adds the sync and async runs with
DCP's collectives on one rank as they were, which shows the slowdown on an idle machine (a loaded one, where
spinning costs more than it saves, hides it or reverses it). The last column, the process's voluntary context
switches per step, tells the two regimes apart unless the cores are oversubscribed: a few hundred while the
OpenMP threads spin, ten times as many once they sleep at every barrier. About 3 minutes on 2 idle cores, 5
with `--before-fix`. Run:

    python benchmarks/checkpoint_slowdown.py [--runs 3] [--steps 10] [--before-fix]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from common import header

warnings.filterwarnings("ignore")

WARMUP = 3  # steps left out at the start (allocator and caches warming up)
AFTER_SAVE = 2  # steps left out after the checkpoint (an async save's files are written meanwhile)


def write_config(path: Path, data: Path, steps: int, mode: str) -> Path:
    """The demo's model and step, a checkpoint after `steps` steps (`mode` "sync" or "async"; "none": only at the
    end) and `steps` more after it."""
    path.write_text(f"""
[model]
preset = "tiny"
hidden_size = 192
head_dim = 24
num_experts = 4
temp_init = 1.0
fp32_logits = false
[data]
path = "{data}"
seq_len = 256
[train]
seed = 0
max_steps = {2 * steps}
micro_batch_size = 16
global_batch_size = 16
precision = "fp32"
eval_every = 0
[optim]
lr = 0.016
ns_dtype = "float32"
[schedule]
warmup_steps = 2
decay_fraction = 0.1
[checkpoint]
every = {steps if mode != "none" else 2 * steps}
keep = 2
async_save = {"true" if mode == "async" else "false"}
[logging]
log_every = 1
tensorboard = false
progress = false
""")
    return path


def one_run(config: Path, run_dir: Path, before_fix: bool) -> None:
    """Train `config` in this process and print each step's tokens/s and voluntary context switches as JSON."""
    from zaya.config import load_config
    from zaya.train.hooks import Hooks
    from zaya.train.metrics import read_metrics
    from zaya.training import build_trainer

    if before_fix:  # DCP's collectives run even with one rank, as they did
        import zaya.checkpoint.manager
        import zaya.checkpoint.tensors

        zaya.checkpoint.manager.alone = zaya.checkpoint.tensors.alone = lambda process_group=None: False
    at_start = {}  # voluntary context switches as each step starts: the step is the time to the next one

    def count(event: str, step: int, path: Path | None = None) -> None:
        if event in ("step", "done"):
            at_start[step] = voluntary_switches()

    build_trainer(load_config(config), run_dir, hooks=Hooks([count])).run()
    rows = read_metrics(run_dir)
    slept = {step: at_start[step] - at_start[step - 1] for step in at_start if step - 1 in at_start}
    print(json.dumps({row["step"]: [row["tokens_per_s"], slept[row["step"]]] for row in rows}))


def voluntary_switches() -> int:
    """How often this process's threads have slept so far (Linux): an OpenMP thread that no longer spin-waits
    sleeps at every barrier."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/status", encoding="ascii") as status:
            total += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


def before_steps(steps: int) -> range:
    """The steps measured before the checkpoint: not the first ones, nor the checkpoint's own (the save's sleeps
    count with it)."""
    return range(WARMUP + 1, steps)


def after_steps(steps: int) -> range:
    return range(steps + AFTER_SAVE + 1, 2 * steps)


def measure(config: Path, run_dir: Path, steps: int, before_fix: bool) -> dict[str, float]:
    """The medians over the steps before the checkpoint and after it of one run in a fresh process: tokens/s
    ("before", "after") and voluntary context switches per step ("slept before", "slept after")."""
    command = [sys.executable, __file__, "--one", str(config), str(run_dir)] + (["--before-fix"] if before_fix else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"the run failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    rows = {int(step): row for step, row in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    before, after = [rows[s] for s in before_steps(steps)], [rows[s] for s in after_steps(steps)]
    return {"before": statistics.median(r[0] for r in before), "after": statistics.median(r[0] for r in after),
            "slept before": statistics.median(r[1] for r in before),
            "slept after": statistics.median(r[1] for r in after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps before the checkpoint, and after it")
    parser.add_argument("--before-fix", action="store_true", help="also run with DCP's collectives on one rank")
    parser.add_argument("--one", nargs=2, type=Path, metavar=("CONFIG", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        one_run(*args.one, args.before_fix)
        return
    before, after = before_steps(args.steps), after_steps(args.steps)
    header(f"tokens/s after a checkpoint vs before it: `tiny` as configs/tiny.toml, fp32, 16 x 256 tokens a step, "
           f"{args.steps} steps, a checkpoint, {args.steps} more; steps {before.start}-{before.stop - 1} against "
           f"{after.start}-{after.stop - 1}; {args.runs} runs of each, each a fresh process")
    from trainer_overhead import make_dataset

    variants = [(mode, False) for mode in ("sync", "async", "none")]
    variants += [(mode, True) for mode in ("sync", "async") if args.before_fix]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_dataset(root)
        for run in range(args.runs):  # interleaved: a change in the machine's load touches every variant alike
            for mode, old in variants:
                name = f"{mode}-{'old' if old else 'new'}-{run}"
                config = write_config(root / f"{name}.toml", data, args.steps, mode)
                results[mode, old].append(measure(config, root / name, args.steps, old))
    print(f"{'save':<28} {'tokens/s before':>15} {'after':>7} {'ratio':>6}  {'runs':<19}  {'target':<7}  "
          "sleeps per step before / after")
    labels = {"none": "none (the runs' own spread)"}
    for (mode, old), runs in results.items():
        label = labels.get(mode, mode) + (" (before the fix)" if old else "")
        print(summary(label, runs, ">= 0.95" if mode != "none" and not old else ""))


def summary(label: str, runs: list[dict[str, float]], target: str) -> str:
    """One line of the table: the medians over `runs`, and each run's ratio."""
    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    ratios = [run["after"] / run["before"] for run in runs]
    return (f"{label:<28} {median('before'):>15,.0f} {median('after'):>7,.0f} {statistics.median(ratios):6.3f}  "
            f"{' '.join(f'{r:.3f}' for r in ratios):<19}  {target:<7}  "
            f"{median('slept before'):,.0f} / {median('slept after'):,.0f}")


if __name__ == "__main__":
    main()
