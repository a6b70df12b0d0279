"""How fast the `zaya` command starts for what needs no model: `zaya --help`, `--version` and `zaya diagnose`, each
timed as a fresh process (median of N), against the peer a command that loads torch pays at the least: a bare
`python -c "import torch"`. Target: `zaya --help` under 1.5 s.

    python benchmarks/cli_startup.py [--repeats 5]

Run it on a fresh virtual environment for the first-run figure (Python compiles the bytecode on the first start,
which the first of the N runs pays and the median leaves out).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import header


def _seconds(args: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    header("zaya command start-up")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run.log"
        log.write_text("[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n")
        zaya = [sys.executable, "-m", "zaya.cli"]
        peer = statistics.median(_seconds([sys.executable, "-c", "import torch"], args.repeats))
        for name, command in (("zaya --help", [*zaya, "--help"]), ("zaya --version", [*zaya, "--version"]),
                              ("zaya diagnose LOG", [*zaya, "diagnose", str(log)])):
            times = _seconds(command, args.repeats)
            ours = statistics.median(times)
            print(f"{name:<22} median {ours:6.3f} s (first {times[0]:6.3f} s) over {args.repeats}   "
                  f"import torch {peer:6.3f} s   ratio {peer / ours:5.1f}x faster"
                  + ("   (target < 1.5 s: met)" if name == "zaya --help" and ours < 1.5 else ""))


if __name__ == "__main__":
    main()
