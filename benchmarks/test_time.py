"""`make test` from a fresh clone, timed as CI runs it (`CI=true`): setup (venv and packages), then ruff and the
whole suite, against the limit of 15 minutes in all; and the fast tier alone (`-m "not slow"`), against 5.

    python benchmarks/test_time.py [--keep DIR]

It clones this repository's HEAD into a temporary directory (uncommitted changes are not part of a fresh
clone), runs `make setup`, `make test` and then the fast tier there with the same `python3` (each with an empty
torch.compile cache), and prints the CPU model, the times and the suite's slowest tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import clone_from_args, machine, run_timed  # noqa: E402

LIMIT_S = 15 * 60.0
FAST_LIMIT_S = 5 * 60.0
CI = {"CI": "true"}  # as CI runs it


def main() -> None:
    with clone_from_args(ROOT, __doc__.split("\n\n")[0], "zaya-test-") as clone:
        _measure(clone)


def _measure(clone: Path) -> None:
    print(machine())
    # torch.compile's cache starts empty, as on a CI machine (not the one earlier runs here filled)
    env = {**CI, "TORCHINDUCTOR_CACHE_DIR": str(clone / ".inductor-cache")}
    setup_s, _ = run_timed(["make", "setup"], clone, env)
    test_s, output = run_timed(["make", "test"], clone, env)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(clone / ".inductor-cache-fast")
    fast_s, fast_output = run_timed([".venv/bin/python", "-m", "pytest", "-m", "not slow"], clone, env)
    total = setup_s + test_s
    counts = re.findall(r"(\d+ passed.*) in ([\d.]+)s", output)
    fast_counts = re.findall(r"(\d+ passed.*) in ([\d.]+)s", fast_output)
    print(f"make test from a fresh clone: {total:.0f} s in all ({total / 60:.1f} min; limit {LIMIT_S / 60:.0f} min): "
          f"{'ok' if total <= LIMIT_S else 'OVER'}")
    print(f"  setup (venv, torch, packages): {setup_s:.0f} s; ruff and the suite: {test_s:.0f} s "
          f"({counts[-1][0] if counts else '?'})")
    print(f"  the fast tier (-m 'not slow'): {fast_s:.0f} s ({fast_counts[-1][0] if fast_counts else '?'}; limit "
          f"{FAST_LIMIT_S / 60:.0f} min): {'ok' if fast_s <= FAST_LIMIT_S else 'OVER'}")
    durations = output[output.find("slowest"):].splitlines()[1:11]
    print("  slowest tests:\n    " + "\n    ".join(line.strip() for line in durations if line.strip()))


if __name__ == "__main__":
    main()
