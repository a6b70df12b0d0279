"""Test-only fault injection: make a training process fail in a chosen way at a chosen point.

Set `ZAYA_FAULTS` to a comma-separated list of `ACTION@EVENT:STEP[@rank=R][@attempt=A]`, for example

    ZAYA_FAULTS="sigkill@step:7"                 die (SIGKILL) just before optimizer step 7
    ZAYA_FAULTS="sigkill@checkpoint-written:6"   die after checkpoint 6's files are written, before its commit
    ZAYA_FAULTS="raise@step:3"                   raise an exception before step 3
    ZAYA_FAULTS="sigkill@step:5@rank=1@attempt=0"   only rank 1 of a job, only before torchrun's first restart

Events: `step` (before an optimizer step), `checkpoint` (before a save starts), `checkpoint-written` (files
written, not yet committed), `committed` (after the commit). Actions: `sigkill`, `raise`. Nothing happens
unless the variable is set, so production runs are unaffected.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from zaya.errors import ZayaError

ENV = "ZAYA_FAULTS"
ACTIONS = ("sigkill", "raise")
EVENTS = ("step", "checkpoint", "checkpoint-written", "committed")


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


@dataclass(frozen=True)
class Fault:
    action: str
    event: str
    step: int
    rank: int | None = None  # None: every rank
    attempt: int | None = None  # torchrun's restart count; None: every attempt


def parse_faults(text: str) -> list[Fault]:
    """Parse `ACTION@EVENT:STEP[@rank=R][@attempt=A][,...]`, refusing anything else with a clear message."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            action, rest, *qualifiers = item.split("@")
            event, step = rest.rsplit(":", 1)
            where = dict(q.split("=", 1) for q in qualifiers)
            if set(where) - {"rank", "attempt"}:
                raise ValueError
            rank, attempt = (int(where[key]) if key in where else None for key in ("rank", "attempt"))
            fault = Fault(action, event, int(step), rank, attempt)
        except ValueError:
            raise ZayaError(f"{ENV}: '{item}' is not ACTION@EVENT:STEP[@rank=R][@attempt=A]") from None
        if fault.action not in ACTIONS or fault.event not in EVENTS:
            raise ZayaError(f"{ENV}: '{item}': actions are {', '.join(ACTIONS)}, events {', '.join(EVENTS)}")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires the faults of `ZAYA_FAULTS` (read once, at construction) meant for this `rank` and `attempt`."""

    def __init__(self, text: str | None = None, *, rank: int = 0, attempt: int = 0):
        faults = parse_faults(os.environ.get(ENV, "") if text is None else text)
        self.faults = [f for f in faults if f.rank in (None, rank) and f.attempt in (None, attempt)]

    def __call__(self, event: str, step: int) -> None:
        for fault in self.faults:
            if fault.event == event and fault.step == step:
                if fault.action == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault at {event} {step}")
