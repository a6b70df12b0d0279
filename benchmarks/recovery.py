"""Recovery under `zaya supervise`: detection latency, time to recover and work lost, per kind of fault.

    python benchmarks/recovery.py [--preset tiny] [--faults 5] [--ranks 2] [--seq 128] [--batch 4]
                                  [--kinds kill hang nan spike] [--precision fp32] [--ns-dtype float32]

One supervised torchrun job per kind of fault, each taking `--faults` injected faults at different steps
(checkpoints every 3 steps; a fault lands 1 or 2 steps after one):

    kill    rank 1 SIGKILLs itself before step S of run i           (the supervisor restarts the group)
    hang    rank 1 SIGSTOPs itself before step S of run i           (heartbeat timeout, SIGKILL, restart)
    nan     step S's loss is NaN                                     (the trainer skips the update)
    spike   step S's loss is multiplied by 20                        (the trainer rolls back, skips the data)

Measured from the files the run leaves: the fault's wall time (the line the fault prints as it fires), the
incident's time (incidents.jsonl), the time the run got past the failed step again ("recovered" records for
the supervisor, metrics rows for the trainer's own signals), and the steps lost (the fault's step minus the
step training resumed from) against the last committed checkpoint before the fault (so "committed steps
lost" is 0 when nothing committed was thrown away). Printed beside what the same fault costs without the
supervisor: a dead rank or a hang waits for the collective timeout (PyTorch's NCCL default 600 s, zaya's
`parallel.timeout_s` default 1800 s) and then for a person to restart the job.

Goal on the CPU tiny run: a hang detected within 5 step times and within 10 s, recovery within 30 s, no
committed step lost.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import header
from trainer_overhead import make_dataset

EVERY = 3  # checkpoint interval, in steps
POLICY = """
[supervisor]
poll_s = 0.25
kill_grace_s = 3.0
max_no_progress = 10
[heartbeat]
factor = 3.0
floor_s = 1.0
first_timeout_s = 120.0
init_timeout_s = 120.0
[training]
spike_ratio = 3.0
spike_window = 5
spike_min_history = 3
"""
WITHOUT = {
    "kill": "torchrun ends the job; down until a person restarts it",
    "hang": "600 s (NCCL default timeout) / 1800 s (zaya default), then a manual restart",
    "nan": "the trainer stops at the NaN (last checkpoint kept); manual restart",
    "spike": "not detected: training goes on from the damaged weights",
}
FAULT_LINE = re.compile(r"zaya fault: (\w+) at step (\d+) pid \d+ time ([\d.]+)")


def fault_steps(count: int) -> list[int]:
    """Steps (optimizer step indices) that take a fault: 1 or 2 steps after a checkpoint, one per interval."""
    return [EVERY * (i + 1) + 1 + i % 2 for i in range(count)]


def write_config(path: Path, data: Path, args, steps: int) -> Path:
    path.write_text(f"""
[model]
preset = "{args.preset}"
temp_init = 1.0
[data]
path = "{data}"
seq_len = {args.seq}
[train]
max_steps = {steps}
micro_batch_size = {args.batch}
global_batch_size = {args.batch * args.ranks}
precision = "{args.precision}"
eval_every = 0
[optim]
ns_dtype = "{args.ns_dtype}"
[checkpoint]
every = {EVERY}
keep = 100
[logging]
tensorboard = false
progress = false
[parallel]
timeout_s = 120.0
""")
    return path


def epoch(iso: str) -> float:
    """Seconds since the epoch of an incidents.jsonl time (UTC, milliseconds)."""
    whole, _, millis = iso.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(millis or 0) / 1000


def run_kind(kind: str, args, data: Path, root: Path) -> dict:
    steps = fault_steps(args.faults)
    faults = {
        "kill": [f"sigkill@step:{s}@rank=1@run={i}" for i, s in enumerate(steps)],
        "hang": [f"sigstop@step:{s}@rank=1@run={i}" for i, s in enumerate(steps)],
        "nan": [f"nan@step:{s}" for s in steps],
        "spike": [f"spike=20@step:{s}" for s in steps],
    }[kind]
    work = root / kind
    work.mkdir()
    config = write_config(work / "run.toml", data, args, steps[-1] + EVERY + 1)
    (work / "policy.toml").write_text(POLICY)
    run, state = work / "run", work / "state"
    command = [sys.executable, "-m", "zaya.cli", "supervise", "--policy", str(work / "policy.toml"), "--state-dir",
               str(state), "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.ranks}", "--max-restarts=0", "--monitor-interval=0.2", "-m", "zaya.cli",
               "train", str(config), "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_FAULTS": ",".join(faults)}
    started = time.time()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(f"{kind}: the supervised run failed ({result.returncode}):\n{result.stdout[-4000:]}")
    wall = time.time() - started

    fired: dict[int, float] = {}
    for log in sorted(state.glob("logs/*/run-*.log")):
        for match in FAULT_LINE.finditer(log.read_text(errors="replace")):
            step, when = int(match.group(2)), float(match.group(3))
            fired[step] = min(when, fired.get(step, when))
    records = [json.loads(line) for line in (state / "incidents.jsonl").read_text().splitlines() if line]
    incidents = [r for r in records if r.get("event") == "incident" and r["signal"] != "straggler"]
    recovered = [r for r in records if r.get("event") == "recovered"]
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row  # the last time each step was trained
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)", (run / "train.log").read_text())]
    step_time = statistics.median(r["step_time"] for r in rows.values())

    detect, recover, lost, committed_lost = [], [], [], []
    for index, step in enumerate(steps):
        fault_time = fired[step]
        incident = incidents[index]
        detect.append(epoch(incident["time"]) - fault_time)
        last_commit = step // EVERY * EVERY  # checkpoints are committed every EVERY steps
        if kind in ("kill", "hang"):
            recover.append(epoch(recovered[index]["time"]) - fault_time)
            back_to = resumed[index]
        elif kind == "nan":
            recover.append(rows[step + 2]["time"] - fault_time)  # the next step that updates the weights
            back_to = step  # nothing is redone; the step's update is dropped
        else:
            recover.append(rows[step + 1]["time"] - fault_time)  # the spiked step, trained again on new data
            back_to = int(re.search(r"rolled back to step (\d+)", incident["outcome"]).group(1))
        lost.append(step - back_to)
        committed_lost.append(max(0, last_commit - back_to))
    return {"kind": kind, "faults": len(steps), "step_time": step_time, "wall": wall,
            "detect": statistics.median(detect), "detect_max": max(detect),
            "recover": statistics.median(recover), "recover_max": max(recover),
            "lost": statistics.median(lost), "lost_max": max(lost), "committed_lost": max(committed_lost),
            "incidents": [(i["signal"], i["action"]) for i in incidents]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--kinds", nargs="+", default=["kill", "hang", "nan", "spike"],
                        choices=["kill", "hang", "nan", "spike"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--ns-dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per kind, then give up")
    parser.add_argument("--keep", default=None, help="an empty directory to run in and keep (logs, incidents)")
    args = parser.parse_args()
    header(f"recovery under zaya supervise: {args.preset}, {args.ranks} ranks x {args.batch} x {args.seq} tokens, "
           f"{args.precision}, {args.faults} faults of each kind")
    with tempfile.TemporaryDirectory(prefix="zaya-recovery-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = make_dataset(root)
        results = [run_kind(kind, args, data, root) for kind in args.kinds]
    print(f"{'fault':<6} {'n':>2} {'step s':>7} {'detect s (max)':>15} {'recover s (max)':>16} "
          f"{'steps lost (max)':>17} {'committed lost':>15}   without the supervisor")
    for r in results:
        print(f"{r['kind']:<6} {r['faults']:>2} {r['step_time']:>7.2f} {r['detect']:>7.2f} ({r['detect_max']:5.2f}) "
              f"{r['recover']:>8.2f} ({r['recover_max']:5.2f}) {r['lost']:>9.1f} ({r['lost_max']:>3})"
              f" {r['committed_lost']:>15}   {WITHOUT[r['kind']]}")
    for r in results:
        if r["kind"] == "hang":
            bound = min(5 * r["step_time"], 10.0)
            verdict = "met" if r["detect_max"] <= bound else "NOT met"
            print(f"hang detected in {r['detect']:.2f} s median ({r['detect'] / r['step_time']:.1f} step times): "
                  f"goal <= {bound:.2f} s {verdict} (worst {r['detect_max']:.2f} s); "
                  f"vs 600 s at the NCCL default timeout: {600 / r['detect']:.0f}x sooner")
        print(f"{r['kind']}: recovery {r['recover']:.2f} s median, goal <= 30 s "
              f"{'met' if r['recover_max'] <= 30 else 'NOT met'} (worst {r['recover_max']:.2f} s); committed steps "
              f"lost: {r['committed_lost']}; decisions: {sorted(set(r['incidents']))}")


if __name__ == "__main__":
    main()
