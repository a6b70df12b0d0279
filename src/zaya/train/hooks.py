"""What the outside installs in the trainer, which runs the same without any: listeners that hear its events
(the supervisor's heartbeat writer, a test's fault injector) and loss scales (a fault injector's NaN or spike).

The events, as the trainer announces them (`step` is the number of completed optimizer steps):

    init, checkpoint_load, step, eval, checkpoint_save, done   entering each section of the run (`step` before
                                                               the step's clocks start)
    step-work                                                  the step's own host work begins (timed as such)
    checkpoint-written                                         a checkpoint's files are written, not committed
    committed                                                  a checkpoint is committed (`path` names it)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol


class Listener(Protocol):
    def __call__(self, event: str, step: int, path: Path | None = None) -> None: ...


class Hooks:
    """The trainer's listeners and loss scales (none by default)."""

    def __init__(self, listeners: Sequence[Listener] = (), loss_scales: Sequence[Callable[[int], float]] = ()):
        self.listeners = list(listeners)
        self.loss_scales = list(loss_scales)

    def __call__(self, event: str, step: int, path: Path | None = None) -> None:
        for listener in self.listeners:
            listener(event, step, path)

    def loss_scale(self, step: int) -> float:
        """What step `step`'s loss is multiplied by: 1.0 unless a hook says otherwise."""
        return math.prod(scale(step) for scale in self.loss_scales)
