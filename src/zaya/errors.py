"""The one exception type for mistakes a user can make (bad files, bad fields, bad arguments), and the exit codes
that the `zaya` commands end with.

The CLI turns a `ZayaError` into a single line on stderr and exit code 2; any other exception is a bug and
keeps its traceback.
"""

import errno
import os
import re

# Exit codes. `zaya train` ends with 0, EXIT_BAD_INPUT or EXIT_PREEMPTED; `zaya supervise` with any of them.
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a ZayaError: bad input, said in one line
EXIT_NO_PROGRESS = 3  # the supervisor restarted K times without getting further
EXIT_STOPPED = 4  # a policy rule said stop, or this node was cordoned
EXIT_EXHAUSTED = 5  # nothing left to run on: every GPU cordoned, or every restart spent
# sysexits' EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the run stopped early with a
# checkpoint (a scheduler's signal, train.max_time_s) and the same command resumes it. Not 0 (the run is not
# done), not 1 (nothing went wrong), not 2 (bad input), not 128 + N (it did not die of the signal).
EXIT_PREEMPTED = 75
# how `zaya train` begins the line it prints when it stops early: a supervisor that sees it under torchrun (which
# turns a worker's 75 into 1) knows the stop for what it is
STOPPED_LINE = "stopped at step"


class ZayaError(Exception):
    """A user-facing error; the message names the file or field and what is wrong with it."""


class StartupFailed(ZayaError):
    """A rank of a multi-process job could not start; rank 0 reports why (once, for the whole job), the
    other ranks exit without repeating it. Whoever shows the message calls `reported()`."""

    def __init__(self, message: str, *, rank: int, on_reported=None):
        super().__init__(message)
        self.rank = rank
        self._on_reported = on_reported

    @property
    def quiet(self) -> bool:
        return self.rank != 0

    def reported(self) -> None:
        if self._on_reported is not None:
            self._on_reported()


# What the disk says when it cannot take a write or give back a read: a person has to act (free space, replace
# the disk), and no restart helps. The CLI names it in one line that `zaya diagnose` files under `storage`.
STORAGE_ERRNOS = {"ENOSPC": "no space left on device", "EDQUOT": "disk quota exceeded",
                  "EROFS": "read-only file system", "EIO": "input/output error", "ESTALE": "stale file handle"}


# the strerror texts of those errnos, as C++ code (torch's file writers) puts them into a RuntimeError's message
_STORAGE_TEXTS = {os.strerror(getattr(errno, name)): name for name in STORAGE_ERRNOS if hasattr(errno, name)}


def storage_error(exc: BaseException) -> OSError | None:
    """The storage `OSError` behind `exc`, if any: itself, its causes and contexts, the exceptions it gathered (an
    exception group; a distributed checkpoint's failures by rank, bare or as (exception, traceback) pairs) or
    carries as arguments, at any depth; or an error of another type whose message is a storage errno's text
    (C++ writers report ENOSPC that way)."""
    seen: set[int] = set()
    todo: list = [exc]
    worded = None
    while todo:
        current = todo.pop()
        if isinstance(current, tuple):  # DCP's (exception, traceback) pairs
            todo += [item for item in current if isinstance(item, BaseException)]
            continue
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and errno.errorcode.get(current.errno) in STORAGE_ERRNOS:
            return current
        if worded is None and not isinstance(current, OSError):
            text = str(current)
            for words, name in _STORAGE_TEXTS.items():
                if words in text:
                    worded = OSError(getattr(errno, name), words, _quoted_path(text))
                    break
        todo += [current.__cause__, current.__context__, *current.args]
        todo += list(getattr(current, "exceptions", None) or ())  # ExceptionGroup
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += list(failures.values())
    return worded


def _quoted_path(text: str) -> str | None:
    """A file name in an error message, if it names one in quotes."""
    found = re.search(r"['\"](/[^'\"]+|[^'\" ]+/[^'\"]+)['\"]", text)
    return found.group(1) if found else None


def storage_message(error: OSError) -> str:
    """One line for a storage error: what the disk said, its errno name, and the file."""
    name = errno.errorcode[error.errno]
    where = f" while writing {error.filename}" if error.filename else ""
    if name in ("EIO", "ESTALE"):
        where = f" on {error.filename}" if error.filename else ""
    return f"{STORAGE_ERRNOS[name]} ({name}){where}"
