"""A deadline on checkpoint I/O: a save or a load that has not finished after `seconds` ends the process.

A write to a hung file system (a dead NFS server, a full metadata server) does not fail, it waits; the training
thread or the background writer would wait with it, for ever, holding every other rank in the next collective. A
timer thread is the one thing still running then: it says what did not finish and exits the process (the kernel
call cannot be interrupted from Python). Nothing committed is lost (a checkpoint is committed by a rename that
comes after its files), and the run resumes from its last committed checkpoint, by the supervisor's restart or
the next submission.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

EXIT_IO_TIMEOUT = 1  # a failure, not bad input: the same command works once the storage does


class Deadline:
    """Armed by `start`, disarmed by `cancel`; between the two, `seconds` may pass at most (0: no deadline)."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self._timer: threading.Timer | None = None

    def start(self) -> Deadline:
        if self.seconds > 0:
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        os.write(2, (f"zaya: error: {self.what} did not finish within {self.seconds:g} s (checkpoint.timeout_s): the "
                     "storage is hung or far too slow; exiting, the run resumes from its last committed "
                     "checkpoint\n").encode())
        os._exit(EXIT_IO_TIMEOUT)


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """The block must finish within `seconds` (0: no limit), or the process ends (see the module docstring)."""
    armed = Deadline(seconds, what).start()
    try:
        yield
    finally:
        armed.cancel()
