"""Shared helpers for the benchmark scripts: the machine's description and a steady-state timer."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def refuse_existing(path: Path | None) -> None:
    """Stop in one line, before any work, if an output file named on the command line is there already: a
    benchmark writes only files it creates."""
    if path is not None and os.path.lexists(path):
        raise SystemExit(f"{path}: already there; name a new file for the results")


def write_new(path: Path, data: object) -> None:
    """`data` as JSON into `path`, created here (never over a file that appeared since `refuse_existing`)."""
    try:
        with open(path, "x", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
    except FileExistsError:
        raise SystemExit(f"{path}: already there; name a new file for the results") from None


def machine() -> str:
    """CPU model (with its family and model numbers and whether it has native bf16 instructions: virtual
    machines often report only "AMD EPYC"), core count and torch build, for the header every benchmark prints."""
    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's entry is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" in fields:
        flags = fields.get("flags", "").split()
        bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
        cpu = (f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
               f"{'native' if bf16 else 'no native'} bf16)")
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    threads = torch.get_num_threads()
    return f"{cpu}, {threads} threads{gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def header(title: str) -> None:
    print(f"# {title}")
    print(f"# date: {datetime.date.today().isoformat()}  machine: {machine()}")


def time_it(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of `fn` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


# ---- one case's peak memory and time, in a process of its own ---------------------------------------------

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def serve_large_allocations_by_mmap() -> bool:
    """Have glibc serve every allocation of 1 MiB or more by its own mmap, so that a freed tensor leaves the
    resident set and a peak is the memory live at once; False where the C library does not take it. Call it
    first thing in a measuring process."""
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    return libc_name is not None and bool(ctypes.CDLL(libc_name).mallopt(_M_MMAP_THRESHOLD, 1 << 20))


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current one (Linux 4.0+), so that a transient before the
    measurement does not hide the measured peak; False where this kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_and_time(step: Callable[[], object], repeats: int) -> dict:
    """`peak_bytes`: the resident set's peak over its value now, for one `step`; then `seconds`, the median of
    `repeats` steps after a warm-up, with freed memory kept as training keeps it (`tune_host_allocator`)."""
    from zaya.device import tune_host_allocator

    reset = _reset_peak_rss()
    base = _peak_rss()
    step()
    peak = _peak_rss() - base
    tune_host_allocator()
    return {"peak_bytes": peak, "seconds": time_it(step, repeats, warmup=1), "peak_reset": reset,
            "threads": torch.get_num_threads()}


def parse_or_run_case(parser: argparse.ArgumentParser, run_case: Callable[[dict], dict]) -> argparse.Namespace | None:
    """The parsed arguments; None in a case's own process (`--case SPEC`, from `run_case_process`), which runs
    `run_case(SPEC)` and prints its results as its last line."""
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is None:
        return args
    print(json.dumps(run_case(json.loads(args.case))))
    return None


def run_case_process(script: str | Path, spec: dict) -> dict:
    """`script --case SPEC` in a fresh process: the JSON object its last line prints (one case's results)."""
    command = [sys.executable, str(Path(script).resolve()), "--case", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"case {spec} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def ratio_line(what: str, ours: float, peer: float, unit: str, higher_is_better: bool = True) -> str:
    ratio = ours / peer if higher_is_better else peer / ours
    return f"{what:<44} ours {ours:>12,.1f} {unit:<10} peer {peer:>12,.1f} {unit:<10} ratio {ratio:5.2f}x"


def run_timed(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run `command` in `cwd` (with `env` added to the environment): (seconds, what it printed); a failure ends
    the benchmark with its output."""
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - started
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}")
    return seconds, result.stdout + result.stderr


def fresh_clone(root: Path, work: Path) -> Path:
    """A clone of `root`'s HEAD in `work`/zaya (uncommitted changes are not part of a fresh clone)."""
    clone = work / "zaya"
    if clone.exists():
        shutil.rmtree(clone)
    subprocess.run(["git", "clone", "--quiet", str(root), str(clone)], check=True)
    return clone


@contextlib.contextmanager
def clone_from_args(root: Path, description: str, prefix: str) -> Iterator[Path]:
    """Parse `--keep DIR` and yield a fresh clone of `root` there, or in a temporary directory removed after."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--keep", type=Path, default=None, help="Clone into this directory and keep it.")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield fresh_clone(root, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(target: Callable[..., None], world: int, *args: object) -> list[dict]:
    """Run `target(rank, world, port, *args, out)` in `world` fresh processes (a free loopback `port` for their
    process group) and return what each wrote to `out/rank{r}.json`, rank by rank."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.get_context("spawn")
        port = free_port()
        processes = [context.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"a rank of the {world}-rank run failed (exit code {process.exitcode})")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
