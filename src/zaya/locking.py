"""One writer per directory: an advisory lock that a run directory's trainer and a dataset's builder hold while they
write, so that a second process on the same directory stops at once instead of deleting the first one's saves or
mixing its files.

The lock is `flock` on a small file beside the directory (`.NAME.lock` in its parent), so that taking it creates
nothing in the directory itself and a command refused here leaves no trace in it; the holder removes the file as
it lets go. The file says who holds it (pid, host, start time) for the refusal's message; the lock itself is the
kernel's, released when the holder exits in any way (a crash, SIGKILL), so a file left by a killed holder never
blocks. On a network file system `flock` is as good as its
lock manager: local and NFSv4 file systems honour it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from zaya.errors import ZayaError


def lock_path(directory: Path) -> Path:
    directory = Path(directory)
    return directory.parent / f".{directory.name}.lock"


# the locks this process holds, by lock file, with how many holders share each: a second trainer built in the
# same process (a resume in a test, an API user's loop) shares its first one's lock rather than blocking on it
_HELD: dict[Path, list] = {}


class DirectoryLock:
    """Held from `acquire` until `release` (or the process's end). `what` names the holder in messages."""

    def __init__(self, directory: Path, what: str):
        self.directory, self.what = Path(directory), what
        self._path: Path | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock, or raise `ZayaError` naming the process that holds it."""
        path = lock_path(self.directory).absolute()
        if path in _HELD:
            _HELD[path][1] += 1
            self._path = path
            return self
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for as long as the lock)
            except OSError as exc:
                raise ZayaError(f"{path}: cannot create the directory's lock file ({exc.strerror or exc})") from None
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(handle)
                handle.close()
                raise ZayaError(f"{self.directory}: in use by {holder}; one process writes a directory at a "
                                "time") from None
            # the holder we waited on may have removed the file as it let go: a lock on that unlinked file would
            # hold nothing, so take it again on the file that is there now
            try:
                if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            handle.close()
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}) + "\n")
        handle.flush()
        _HELD[path] = [handle, 1]
        self._path = path
        return self

    def release(self) -> None:
        if self._path is None:
            return
        held = _HELD[self._path]
        held[1] -= 1
        if held[1] == 0:
            # removed while still locked (a command leaves nothing behind), then the descriptor's close lets go
            with contextlib.suppress(OSError):
                self._path.unlink()
            held[0].close()
            del _HELD[self._path]
        self._path = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(handle) -> str:
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
    except ValueError:
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process"
    return (f"{info.get('what', 'another process')} (pid {info['pid']} on host {info.get('host', '?')}, "
            f"since {info.get('since', '?')})")
