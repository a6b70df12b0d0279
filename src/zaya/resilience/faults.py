"""Test-only fault injection: make a training process fail in a chosen way at a chosen point.

The injector is one of the trainer's listeners (it hears the trainer's events and may scale a step's loss),
installed by the `zaya` command when `ZAYA_FAULTS` is set and never otherwise: the step has no branch of its
own for it. Set `ZAYA_FAULTS` to a comma-separated list of `ACTION[=VALUE]@EVENT:STEP[@rank=R][@attempt=A][@run=N]`:

    sigkill@step:7                  die (SIGKILL) just before optimizer step 7 (the 8th)
    sigkill@checkpoint-written:6    die after checkpoint 6's files are written, before its commit
    raise@step:3                    raise an exception (a crash) before step 3
    sigterm@step:5@rank=1           rank 1 sends itself SIGTERM as step 5 begins (`sigusr1` likewise): what a
                                    scheduler sends before it kills, arriving in the middle of a step
    sigstop@step:4@rank=1           rank 1 stops itself (SIGSTOP): a hang, as a stuck kernel looks from outside
    slow=0.5@step:2@rank=1          rank 1 sleeps 0.5 s in its own work of every step from step 2 on
    nan@step:5                      step 5's loss is NaN (so are its gradients)
    spike=8@step:5                  step 5's loss (and its gradients) are multiplied by 8
    corrupt@committed:4             flip bytes in one tensor shard of checkpoint 4 right after its commit
    print@step:3                    print the line in `ZAYA_FAULT_LINE` on stderr (a fake kernel or NCCL line)
    block@step:2                    block in a read that never returns (a FIFO no one writes): stuck I/O

Qualifiers: `rank` (one rank only), `attempt` (the job's attempt under torchrun,
`Launch.attempt`: the same on every rank), `run` (the supervisor's restart count,
`ZAYA_RUN_ATTEMPT`). Events: `step` (before an optimizer step), `checkpoint` (before a save starts),
`checkpoint-written` (files written, not yet committed), `committed` (after the commit).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from zaya.errors import ZayaError

ENV = "ZAYA_FAULTS"  # named in messages; zaya.resilience.supervision reads it
ACTIONS = ("sigkill", "raise", "sigstop", "sigterm", "sigusr1", "slow", "nan", "spike", "corrupt", "print", "block")
VALUED = {"slow": 0.5, "spike": 8.0}  # actions that take a value, and its default
EVENTS = ("step", "checkpoint", "checkpoint-written", "committed")
# the trainer's events a fault can fire at, by their name here; "step-work" is inside the step's timed host work,
# so that a `slow` rank shows as a straggler
_TRAINER_EVENTS = {"step-work": "step", "checkpoint_save": "checkpoint", "checkpoint-written": "checkpoint-written",
                   "committed": "committed"}


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


@dataclass(frozen=True)
class Fault:
    action: str
    event: str
    step: int
    rank: int | None = None  # None: every rank
    attempt: int | None = None  # the job's attempt under torchrun; None: every attempt
    value: float = 0.0
    run: int | None = None  # the supervisor's restart count; None: every run


def parse_faults(text: str) -> list[Fault]:
    """Parse the `ZAYA_FAULTS` syntax, refusing anything else with a clear message."""
    faults = []
    syntax = "ACTION[=VALUE]@EVENT:STEP[@rank=R][@attempt=A][@run=N]"
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            action, rest, *qualifiers = item.split("@")
            action, _, value = action.partition("=")
            event, step = rest.rsplit(":", 1)
            where = dict(q.split("=", 1) for q in qualifiers)
            if set(where) - {"rank", "attempt", "run"}:
                raise ValueError
            rank, attempt, run = (int(where[key]) if key in where else None for key in ("rank", "attempt", "run"))
            if value and action not in VALUED:
                raise ValueError
            fault = Fault(action, event, int(step), rank, attempt, float(value) if value else VALUED.get(action, 0.0),
                          run)
        except ValueError:
            raise ZayaError(f"{ENV}: '{item}' is not {syntax}") from None
        if not 0 <= fault.value <= 3600:  # a `slow` of inf or 1e300 would overflow the sleep
            raise ZayaError(f"{ENV}: '{item}': a value must be a number in [0, 3600]")
        if fault.action not in ACTIONS or fault.event not in EVENTS:
            raise ZayaError(f"{ENV}: '{item}': actions are {', '.join(ACTIONS)}, events {', '.join(EVENTS)}")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires the faults of a `ZAYA_FAULTS` text meant for this rank, torchrun attempt and supervisor run. As a
    trainer listener it is called with the trainer's events; `loss_factor` is its loss scale."""

    def __init__(self, text: str, *, rank: int = 0, attempt: int = 0, run: int = 0, line: str = ""):
        self.faults = [f for f in parse_faults(text)
                       if f.rank in (None, rank) and f.attempt in (None, attempt) and f.run in (None, run)]
        self.line = line  # what `print` prints
        self._fired: set[Fault] = set()

    def __call__(self, event: str, step: int, path: Path | None = None) -> None:
        event = _TRAINER_EVENTS.get(event)
        if event is None:
            return
        for fault in self.faults:
            if fault.event != event:
                continue
            if fault.action == "slow" and step >= fault.step:
                time.sleep(fault.value)
            if fault.step != step:
                continue
            if fault.action in ("sigkill", "sigstop", "raise"):
                _announce(fault, step)
            if fault.action == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action in ("sigterm", "sigusr1"):
                os.kill(os.getpid(), signal.SIGTERM if fault.action == "sigterm" else signal.SIGUSR1)
            elif fault.action == "raise":
                raise InjectedFault(f"injected fault at {event} {step}")
            elif fault.action == "print":
                print(self.line or f"injected log line at {event} {step}", file=sys.stderr, flush=True)
            elif fault.action == "corrupt" and path is not None:
                corrupt_shard(path)
            elif fault.action == "block":
                _announce(fault, step)
                _block_in_a_read()

    def loss_factor(self, step: int) -> float:
        """What step `step`'s loss is multiplied by (1.0 unless a `nan` or `spike` fault is set for it). Each
        fires once per process: a step trained again after a rollback is clean, as after a real spike."""
        factor = 1.0
        for fault in self.faults:
            if fault.event == "step" and fault.step == step and fault not in self._fired:
                if fault.action == "nan":
                    factor = float("nan")
                elif fault.action == "spike":
                    factor *= fault.value
                else:
                    continue
                self._fired.add(fault)
                _announce(fault, step)
        return factor


def _announce(fault: Fault, step: int) -> None:
    """One line on stderr when a fault fires, with its wall time: the start of the clock for recovery figures."""
    print(f"zaya fault: {fault.action} at {fault.event} {step} pid {os.getpid()} time {time.time():.3f}",
          file=sys.stderr, flush=True)


def corrupt_shard(checkpoint: Path) -> Path:
    """Flip bytes in the middle of the largest tensor file of a checkpoint directory (its CRC then fails)."""
    files = sorted((p for p in Path(checkpoint).glob("*.safetensors")), key=lambda p: p.stat().st_size)
    if not files:
        files = sorted((p for p in Path(checkpoint).rglob("*") if p.is_file() and p.suffix not in (".json",)),
                       key=lambda p: p.stat().st_size)
    target = files[-1]
    with open(target, "r+b") as handle:
        size = target.stat().st_size
        handle.seek(size // 2)
        chunk = handle.read(64)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in chunk))
    return target


def _block_in_a_read() -> None:
    """Open a FIFO that nothing will ever write: the call blocks in the kernel, as a read from a dead NFS server or
    a FIFO among the inputs does."""
    import tempfile

    fifo = Path(tempfile.mkdtemp(prefix="zaya-block-")) / "never"
    os.mkfifo(fifo)
    with open(fifo, "rb") as handle:
        handle.read()
