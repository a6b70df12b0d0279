"""The processes of a worker group as the kernel shows them in /proc: their state, their tree, their session, and
the supervisor's mark in their environment.

torchrun starts each worker in a session of its own, so neither `killpg` on torchrun nor waiting for it
reaches them; the supervisor (and the tests that clean up after it) find them as torchrun's descendants. A
worker's background child outlives it: it stays in the group's session (`sleep 60 &`), or it left it (`setsid`)
and, its parent gone, was reparented to the supervisor (its subreaper) or to init. The supervisor marks every
group it starts with a token in the environment (`MARK_ENV`), which every process of the group inherits, so
those are found too (`attempt_processes`). Zombies are left out: they are gone, only not yet reaped.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from zaya.resilience.supervision import MARK_ENV

KILL_WAIT_S = 10.0  # after SIGKILL: how long the processes of a group get to be gone
_ENVIRON_CAP = 4 << 20  # a process's environment is at most a few MiB (ARG_MAX)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T for stopped, Z), or None if it is gone."""
    if not 0 < pid < 1 << 22:
        return None
    fields = _stat(pid)
    return fields[0] if fields else None


def process_table(zombies: bool = True) -> dict[int, tuple[int, int, int]]:
    """Every process (but the zombies, unless `zombies`): pid -> (parent pid, process group, session)."""
    table = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields and len(fields) > 3 and (zombies or fields[0] != "Z"):
            table[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def descendants(pid: int, table: dict[int, tuple[int, int, int]] | None = None) -> list[int]:
    """Every process below `pid`, children before grandchildren."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for child, (parent, _, _) in (process_table() if table is None else table).items():
        children[parent].append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def carries(pid: int, mark: str) -> bool:
    """Whether `mark` is in the environment `pid` started with (False for a process we may not read)."""
    needle = f"{MARK_ENV}={mark}".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            data = handle.read(_ENVIRON_CAP)
    except OSError:
        return False
    return needle in data.split(b"\0")


def attempt_processes(leader: int, mark: str, *, leader_reaped: bool) -> set[int]:
    """The live processes of the group that `leader` started with `mark`: its descendants (while it is not reaped:
    after that its number may be another process's), any process that carries the mark (a child that left the
    session and outlived its parent), and the members of its session and process group that are ours (reparented
    to us, the subreaper): a session id alone could be a reused number."""
    table = process_table(zombies=False)
    own = os.getpid()
    found = set() if leader_reaped else {leader, *descendants(leader, table)}
    ours = set(descendants(own, table))
    found |= {pid for pid in ours if leader in table[pid][1:]}
    found |= {pid for pid in table if pid != own and pid not in found and carries(pid, mark)}
    return {pid for pid in found if pid in table and pid != own}


def signal_all(pids, sig) -> None:
    """Send `sig` to every pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError, OverflowError):
            os.kill(pid, sig)


def end_group(process: subprocess.Popen, alive: Callable[[], set[int]], *, graceful: bool, grace: float) -> None:
    """End every process `alive()` finds (the group `process` started): SIGTERM and `grace` seconds to exit when
    `graceful`, then SIGKILL for all that are left and any they started meanwhile, until none is left (at most
    `KILL_WAIT_S`); those that were our children (orphans we inherited as their subreaper) are reaped."""
    victims = alive()
    seen = set(victims)
    if graceful and victims:
        signal_all(victims, signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
        while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid in victims):
            time.sleep(0.05)
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        victims = alive()
        seen |= victims
        signal_all(victims, signal.SIGKILL)
        _reap(seen - {process.pid})
        if process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.1)
        if not victims or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(max(deadline - time.monotonic(), 0.1))
    _reap(seen - {process.pid})


def _reap(pids) -> None:
    """Collect the exit status of those of `pids` that are our children and have died: as the subreaper we inherit
    a group's orphans, and an unreaped one stays a zombie until we exit."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
