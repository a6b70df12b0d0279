"""`zaya launch [TORCHRUN OPTIONS] COMMAND ARGS...`: torchrun, run in this process, for a zaya command, ending
in one line where torchrun ends in a traceback.

    zaya launch --nproc-per-node 8 train configs/small.toml --run-dir runs/small
      = torchrun --nproc-per-node 8 -m zaya.cli train configs/small.toml --run-dir runs/small

The options are torchrun's own, parsed by torchrun's own parser (`torch.distributed.run`), so that every one
of them means what it means there; only the program is fixed: the zaya command named after them, run as
`python -m zaya.cli COMMAND ARGS...` on every worker. The agent, the rendezvous, restarts and the workers are
torchrun's, unchanged. What differs is the end:

    a signal to the launcher   torchrun's agent passes it on to its workers and waits up to its
                               `--shutdown-timeout` for them (`zaya train` finishes its step and writes a
                               checkpoint), then raises `SignalException`, which torchrun prints as a
                               traceback of some thirty lines. Here: one line, exit 128 + the signal (SIGINT
                               130, SIGTERM 143, SIGUSR1 with `--signals-to-handle` 138).
    the same signal again      torchrun's agent, already stopping, raises again inside its own wait, then
                               sends its workers SIGTERM (which a stopping trainer takes for the request it
                               has), SIGKILLs them after `--shutdown-timeout` and prints two tracebacks.
                               Here the workers get the signal itself: a second Ctrl-C aborts `zaya train`
                               at once, as it does without a launcher.
    a worker fails             torchrun prints `ChildFailedError` with a traceback and exits 1. Here: one line
                               naming the first rank that failed and its exit code, which becomes the
                               launcher's (128 + N for a worker killed by signal N); 75 when every worker
                               stopped early with a checkpoint (train.max_time_s, a scheduler's signal passed
                               on by torchrun), as `zaya train` ends alone.

Anything that goes wrong before the agent runs (a bad option) is torchrun's usage message, exit 2; a Ctrl-C
before the workers start aborts as any command does.
"""

from __future__ import annotations

import contextlib
import os
import signal
from argparse import Namespace
from collections.abc import Callable, Iterator, Sequence

from zaya.errors import EXIT_PREEMPTED, ZayaError

LINE = "zaya launch"  # how the launcher's own lines begin
_ENTRY = "zaya.cli"  # the module every worker runs


def torchrun_args(argv: Sequence[str], commands: Sequence[str]) -> Namespace:
    """torchrun's arguments for `zaya launch ARGV`: its options as its own parser reads them, and the program
    `-m zaya.cli COMMAND ARGS...`. `commands` are the zaya commands a worker may run."""
    from torch.distributed.run import get_args_parser

    example = "e.g. zaya launch --nproc-per-node 2 train CONFIG"
    if not argv:
        raise ZayaError(f"{LINE} needs torchrun's options and then the zaya command to run, {example}")
    parser = get_args_parser()
    parser.prog = LINE
    args = parser.parse_args(list(argv))
    if args.module or args.no_python or args.run_path:
        raise ZayaError(f"-m, --no-python and --run-path do not apply to {LINE}, which runs a zaya command "
                        f"({example}); torchrun itself runs other programs")
    if args.training_script not in commands:
        raise ZayaError(f"'{args.training_script}' is not a zaya command, which {LINE} runs on the workers (one of: "
                        f"{', '.join(commands)}); {example}")
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.module, args.training_script = True, _ENTRY
    return args


def launch(argv: Sequence[str], commands: Sequence[str], say: Callable[[str], None]) -> int:
    """Run `zaya launch ARGV` (see the module docstring); returns the exit code, having said why when not 0."""
    args = torchrun_args(argv, commands)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with _second_signal_to_workers():
            torchrun.run(args)
    except SignalException as exc:
        sig = signal.Signals(exc.sigval)
        code = 128 + sig.value
        say(f"{LINE}: {sig.name}: passed on to the workers, which have ended (`zaya train` stops after its step "
            f"with a checkpoint, said above, if torchrun's --shutdown-timeout leaves it the time; the same command "
            f"resumes); exit code {code}")
        return code
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        codes = {failure.exitcode for failure in exc.failures.values()}
        if codes == {EXIT_PREEMPTED}:
            say(f"{LINE}: every worker stopped early with a checkpoint; the same command resumes; exit code "
                f"{EXIT_PREEMPTED}")
            return EXIT_PREEMPTED
        if first.exitcode < 0:
            code, how = 128 - first.exitcode, f"was killed by {first.signal_name()}"
        else:
            code, how = first.exitcode, f"exited with code {first.exitcode}"
        others = len(exc.failures) - 1
        say(f"{LINE}: rank {rank} (pid {first.pid}) {how}, the first to fail"
            + (f" ({others} more did after it)" if others else "") + f"; its lines above say why; exit code {code}")
        return code
    return 0


@contextlib.contextmanager
def _second_signal_to_workers() -> Iterator[None]:
    """While torchrun runs: its agent's signal handler as it is for the first signal (it raises `SignalException`,
    and the agent passes the signal on to its workers and waits for them), and for every later one, the signal
    passed on to the workers at once (torchrun's would raise again inside that wait, and the agent would then
    send them SIGTERM, not the signal, and SIGKILL them after its shutdown timeout)."""
    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api, "_terminate_process_handler", None)
    if original is None:  # a torch that handles signals otherwise: its own behaviour
        yield
        return
    received: list[int] = []

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            original(signum, frame)
        _signal_workers(signum)

    api._terminate_process_handler = on_signal  # looked up by name when the agent installs its handlers
    try:
        yield
    finally:
        api._terminate_process_handler = original


def _signal_workers(signum: int) -> None:
    """Send `signum` to this process's workers: its children that lead a process group of their own (torchrun
    starts each worker in a session of its own, as it signals them), not helpers such as a resource tracker."""
    from zaya.resilience.processes import process_table

    me = os.getpid()
    for pid, (parent, group, _session) in process_table(zombies=False).items():
        if parent == me and group == pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)
