"""The one way tests run several ranks: a function on N ranks of a pool of processes started once per session,
or a command line (torchrun, the supervisor), each with a deadline. A hung test fails with what it printed
instead of hanging the suite.

Each rank of the pool is a fork server: a process started once, with the interpreter, torch and zaya imported
(and nothing computed, so that forking is safe), which forks a fresh child for every job. A job's rank is that
child: torchrun's environment with a fresh port, no state left by an earlier test (torch.distributed keeps
some that its teardown does not clear), and the price of a fork instead of an interpreter start. A job that
fails or runs past its deadline takes the pool down with it (a rank left waiting in a collective cannot be
trusted), and the next job starts a new one. What a rank writes to its stdout and stderr goes to a file of the
pool's, whose end the failure shows; a rank past its deadline first writes its Python stack there. The pool's
processes die with the test process, however it ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

POOL_SIZE = 4  # the largest world size a test asks for
DUMP_SIGNAL = signal.SIGUSR2  # a rank past its deadline writes its stack on it (the servers ignore it)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankPool:
    """Up to `size` rank processes, started on first use (see the module docstring)."""

    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self._context = mp.get_context("spawn")
        self._workers: list[tuple[mp.Process, mp.Queue]] = []
        self._results: mp.Queue | None = None
        self._logs: Path | None = None  # each rank's output, job after job

    def _start(self) -> None:
        self._results = self._context.Queue()
        self._logs = Path(tempfile.mkdtemp(prefix="zaya-test-ranks-"))
        for rank in range(self.size):
            tasks = self._context.Queue()
            process = self._context.Process(target=_serve, args=(rank, tasks, self._results, os.getpid()),
                                            daemon=True, name=f"zaya-test-rank-{rank}")
            process.start()
            self._workers.append((process, tasks))

    def close(self) -> None:
        """Stop every rank at once, with the children it forked (they may be stuck in a collective)."""
        self._signal(signal.SIGKILL)
        for process, _ in self._workers:
            process.join(5)
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)
        self._workers, self._results, self._logs = [], None, None

    def _signal(self, signum: int) -> None:
        for process, _ in self._workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)

    def _output(self, ranks: Sequence[int]) -> str:
        """The end of what these ranks printed in the job."""
        parts = []
        for rank in ranks:
            path = self._logs / f"rank{rank}.log"
            text = path.read_text(errors="replace")[-6000:] if path.is_file() else ""
            parts.append(f"--- rank {rank} output\n{text}")
        return "\n".join(parts)

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
            env: dict[str, str] | None = None) -> list[Any]:
        """`fn(rank, world_size, *args)` on ranks 0 .. world_size - 1, each with torchrun's environment (its agent's
        store, on loopback) plus `env`, and one intra-op thread; returns their results, rank by rank. The first
        rank to fail fails the test with its traceback and what the ranks printed. `fn` must be a module-level
        function."""
        if not 1 <= world_size <= self.size:
            raise ValueError(f"the pool has {self.size} ranks, not {world_size}")
        if not self._workers or not all(process.is_alive() for process, _ in self._workers):
            self.close()
            self._start()
        job = pickle.dumps((fn, args))
        # the job's store lives here, as torchrun's agent keeps it: a rank that leaves early takes nothing with it
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for rank in range(world_size):
            job_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", **(env or {})}
            self._workers[rank][1].put((list(sys.path), job, job_env, str(self._logs / f"rank{rank}.log")))
        deadline = time.monotonic() + timeout
        outcomes: dict[int, Any] = {}
        try:
            while len(outcomes) < world_size:
                try:
                    rank, ok, value = self._results.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r in range(world_size) if r not in outcomes and not self._workers[r][0].is_alive()]
                    if dead:
                        code = self._workers[dead[0]][0].exitcode
                        raise AssertionError(f"rank {dead[0]} exited with code {code} and no result\n"
                                             f"{self._output(range(world_size))}") from None
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(outcomes))
                        self._signal(DUMP_SIGNAL)  # where each rank is stuck, into its output
                        time.sleep(1.0)
                        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s\n"
                                             f"{self._output(range(world_size))}") from None
                    continue
                if not ok:
                    failure = value if value.startswith(f"rank {rank} ") else f"rank {rank} failed:\n{value}"
                    raise AssertionError(f"{failure}\n{self._output(range(world_size))}")
                outcomes[rank] = value
        except BaseException:
            self.close()
            raise
        finally:
            del store
        return [outcomes[rank] for rank in range(world_size)]


def _die_with(parent: int) -> None:
    """Be killed when the process that started this one ends (Linux), even by SIGKILL: no rank outlives a test
    process that died."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def _serve(rank: int, tasks: mp.Queue, results: mp.Queue, parent: int) -> None:
    """A pool rank: fork a child for each job, forward its result (see the module docstring)."""
    os.setsid()  # the pool kills the server and the children it forked together
    _die_with(parent)
    signal.signal(DUMP_SIGNAL, signal.SIG_IGN)
    # loaded once, every child inherits them
    import torch.distributed  # noqa: F401

    import zaya.cli
    import zaya.training  # noqa: F401

    server = os.getpid()
    while True:
        path, job, env, log = tasks.get()
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            _die_with(server)
            _child(path, job, env, log, write)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(child, 0)
        if data:
            results.put((rank, *pickle.loads(data)))
        else:
            code = os.waitstatus_to_exitcode(status)
            results.put((rank, False, f"rank {rank} exited with code {code} and no result"))


def _child(path: list[str], job: bytes, env: dict[str, str], log: str, write: int) -> None:
    """One job's rank: run it with its output in `log`, write (ok, value) to the pipe, exit without the parent's
    cleanup."""
    import torch
    import torch.distributed as dist

    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    code = 0
    try:
        sys.path[:] = path  # the test module that `fn` comes from is importable by name
        os.environ.update(env)
        torch.set_num_threads(1)
        fn, args = pickle.loads(job)
        outcome = (True, fn(int(env["RANK"]), int(env["WORLD_SIZE"]), *args))
    except BaseException:
        outcome, code = (False, traceback.format_exc()), 1
    try:
        data = pickle.dumps(outcome)
    except Exception:
        data, code = pickle.dumps((False, f"the result cannot be pickled:\n{traceback.format_exc()}")), 1
    with os.fdopen(write, "wb") as pipe:
        pipe.write(data)
    # DTensor collectives leave reference cycles holding gloo work; collected during interpreter finalisation they
    # abort the process now and then ("terminate called without an active exception")
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_POOL: RankPool | None = None


def rank_pool() -> RankPool:
    """The session's pool (tests/conftest.py closes it at the end of the session)."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
    return _POOL


def close_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` ranks of the session's pool: `RankPool.run`."""
    return rank_pool().run(fn, world_size, *args, timeout=timeout, env=env)


def summed_over_ranks(loss, model) -> tuple[Any, dict[str, Any]]:
    """After `loss.backward()` on every rank: the loss and each parameter's gradient summed over the ranks (the
    parameters without a gradient left out), as one device's would be."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad.clone()
            dist.all_reduce(grads[name])
    return total, grads


def zaya_on_rank(rank: int, world_size: int, args: Sequence[str]) -> tuple[int, str, str]:
    """`zaya ARGS` as torchrun would run it on this rank (the pool has set its environment): (exit code, stdout,
    stderr). Use it with `run_distributed`: the `zaya` command's own code path on N ranks, without N fresh
    interpreters."""
    from runs import zaya_command

    return zaya_command(args)


def zaya_compiled_on_rank(rank: int, world_size: int, args: Sequence[str]) -> tuple[int, str, str, dict]:
    """`zaya_on_rank`, with what the run compiles compiled through AOT autograd without generating code
    (`aot_eager`: every graph traced as inductor would get it, without a C++ build): (exit code, stdout, stderr,
    {"functions": the qualified names handed to `torch.compile`, "graphs": the graphs the compiler made})."""
    import torch
    from torch._dynamo.utils import counters

    compile_, names = torch.compile, []

    def compile_aot_eager(fn, **options):
        names.append(fn.__qualname__)
        return compile_(fn, **{**options, "backend": "aot_eager"})

    torch.compile = compile_aot_eager  # the rank is a fork of its own: nothing else sees it
    counters.clear()
    code, out, err = zaya_on_rank(rank, world_size, args)
    return code, out, err, {"functions": names, "graphs": counters["stats"]["unique_graphs"]}


def zaya_ranks(args: Sequence[str], world_size: int, *, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """`zaya_on_rank` on `world_size` ranks of the pool: each rank's (exit code, stdout, stderr)."""
    return run_distributed(zaya_on_rank, world_size, [str(a) for a in args], timeout=timeout, env=env)


def zaya_train(config: Path | str, run_dir: Path | str, world_size: int, *sets: str, timeout: float = 400.0,
               env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """`zaya train CONFIG --run-dir RUN_DIR --set KEY=VALUE ...` on `world_size` ranks of the pool: each rank's
    (exit code, stdout, stderr)."""
    return zaya_ranks(train_args(config, run_dir, *sets), world_size, timeout=timeout, env=env)


def train_args(config: Path | str, run_dir: Path | str, *sets: str) -> list[str]:
    """`train CONFIG --run-dir RUN_DIR --set KEY=VALUE ...`, the arguments of `zaya train`."""
    return [str(a) for a in ("train", config, "--run-dir", run_dir, *(a for s in sets for a in ("--set", s)))]


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


def torchrun(*args: str, nproc: int, timeout: float = 300.0,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m zaya.cli ARGS` with one intra-op thread per worker."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "zaya.cli", *args]
    return run_command(command, timeout=timeout, env={"OMP_NUM_THREADS": "1", **(env or {})})


def wait_for(what: Callable[[], bool], process: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    """Wait until `what()` holds for a command started in a session of its own that writes `log`; if it exits
    first or `timeout` passes, kill its session and fail with the end of its log."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline or process.poll() is not None:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"not within {timeout} s (exit {process.poll()}): {log.read_text()[-4000:]}")
        time.sleep(0.05)
