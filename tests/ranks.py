"""The one way tests start several processes: a function on N fresh ranks, or a command line (torchrun), each
with a deadline. A hung test fails with what it printed instead of hanging the suite."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    env: dict[str, str] | None = None, threads: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes and return their results, rank by rank.

    Each process sees the environment torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT on loopback) plus `env`, and runs `threads` intra-op threads. The first rank to fail fails the
    test with its traceback, and the others are killed; so are all of them past `timeout` seconds. `fn` must
    be a module-level function (it is pickled into the new processes)."""
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, port, args, env or {}, threads, results),
                        daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, Any] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                silent = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode is not None]
                if silent:
                    try:  # a report written just before the process exited
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        code = processes[silent[0]].exitcode
                        raise AssertionError(f"rank {silent[0]} exited with code {code} and no result") from None
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                else:
                    continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            outcomes[rank] = value
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [outcomes[rank] for rank in range(world_size)]


def _child(fn, rank: int, world_size: int, port: int, args: tuple, env: dict, threads: int, results) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # DTensor collectives leave reference cycles holding gloo work; collected during interpreter
        # finalisation they abort the process now and then ("terminate called without an active exception")
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_command(args: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run a command (in a process group of its own, so that torchrun's workers go with it) and return what it
    printed; past `timeout` seconds the whole group is killed and the test fails with the output so far."""
    process = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"{' '.join(map(str, args))} did not finish within {timeout:.0f} s\n"
                             f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # anything it left behind
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def torchrun(*args: str, nproc: int, timeout: float = 300.0, env: dict[str, str] | None = None,
             extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m zaya.cli ARGS` with one intra-op thread per worker."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *extra, "-m", "zaya.cli", *args]
    return run_command(command, timeout=timeout, env={"OMP_NUM_THREADS": "1", **(env or {})})
