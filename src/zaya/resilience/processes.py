"""The processes of a worker group as the kernel shows them in /proc: their state and their tree.

torchrun starts each worker in a session of its own, so neither `killpg` on torchrun nor waiting for it
reaches them; the supervisor (and the tests that clean up after it) find them as torchrun's descendants.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T for stopped, Z), or None if it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children before grandchildren."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields and len(fields) > 1:
            children[int(fields[1])].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids, sig) -> None:
    """Send `sig` to every pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
