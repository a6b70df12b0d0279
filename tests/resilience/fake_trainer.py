"""A stand-in for `zaya train` under the supervisor, for the tests of the supervisor's own decisions: it reads the
supervisor's settings from its environment as `zaya train` does, writes the same heartbeats (as its torchrun rank,
if any), and fails or stops the way it is told, in a fraction of a second (it imports no torch); on SIGTERM it
stops after its step as `zaya train` does.

    python fake_trainer.py --steps 12 [--crash-at 4 --line "Xid ..."] [--stop-at 3] [--spoof-pid PID]

--spoof-pid writes heartbeats no rank of ours wrote beside its own: one of rank 1 with PID and a time long past
(a hang, whose process is not ours), a malformed one and one that is not JSON; then it waits to be stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from zaya.errors import EXIT_PREEMPTED, STOPPED_LINE
from zaya.resilience.heartbeat import Heartbeat
from zaya.resilience.supervision import Supervision


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--crash-at", type=int, default=None, help="exit 1 before this step")
    parser.add_argument("--line", default="", help="what to print on stderr before crashing")
    parser.add_argument("--stop-at", type=int, default=None, help="stop early after this step, as on max_time_s")
    parser.add_argument("--spoof-pid", type=int, default=None, help="write foreign heartbeats, then wait")
    args = parser.parse_args()
    directory = Supervision.from_environ(os.environ).heartbeat_dir
    beat = Heartbeat(directory, rank=int(os.environ.get("RANK", "0")))  # under torchrun, each rank its own
    beat("init", 0)
    if args.spoof_pid is not None:
        spoofed = {"rank": 1, "pid": args.spoof_pid, "section": "step", "step": 0, "time": time.time() - 1e4}
        (directory / "rank-1.json").write_text(json.dumps(spoofed))
        (directory / "rank-2.json").write_text(json.dumps({"rank": 2, "pid": "1"}))
        (directory / "rank-3.json").write_text("not json")
        while True:
            beat("step", 0)
            time.sleep(0.1)
    signalled = []  # SIGTERM, as `zaya train` takes it: the step ends, a checkpoint, exit 75
    signal.signal(signal.SIGTERM, lambda *_: signalled.append(True))
    for step in range(args.steps):
        beat("step", step)
        if step == args.crash_at:
            print(args.line or f"crash at step {step}", file=sys.stderr, flush=True)
            print("RuntimeError: injected crash", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.02)
        if step + 1 == args.stop_at or signalled:
            beat("checkpoint_save", step + 1)
            why = "SIGTERM" if signalled else "max_time_s"
            print(f"{STOPPED_LINE} {step + 1} ({why}); exit code {EXIT_PREEMPTED}: resubmit the same command",
                  flush=True)
            return EXIT_PREEMPTED
    beat("done", args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
