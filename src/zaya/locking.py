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
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import os_reason


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
            except OSError as exc:
                raise ZayaError(f"{path}: cannot create the directory's lock file ({os_reason(exc)})") from None
            handle = _open_lock_file(path)
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(handle)
                handle.close()
                raise ZayaError(f"{self.directory}: in use by {holder}; one process writes a directory at a "
                                "time") from None
            # the holder we waited on may have removed the file as it let go: a lock on that unlinked file would
            # hold nothing, so take it again on the file that is there now
            if _same_file(path, handle):
                break
            handle.close()
        if os.fstat(handle.fileno()).st_size and _record(handle) is None:
            # a file of that name that zaya did not write (a killed holder leaves its record): not ours to overwrite
            handle.close()
            raise ZayaError(f"{path}: exists and is not a zaya lock file; refusing to overwrite it")
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
            # removed while still locked (a command leaves nothing behind), then the descriptor's close lets go;
            # only if the name still is our file: it is not ours to remove otherwise
            if _same_file(self._path, held[0]):
                with contextlib.suppress(OSError):
                    self._path.unlink()
            held[0].close()
            del _HELD[self._path]
        self._path = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _open_lock_file(path: Path):
    """The lock file, created if missing, opened without following a link (a link planted at its name would
    make the holder's record write through it into another file), and only if it is a regular file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ZayaError(f"{path}: the lock file is a symbolic link; refusing to use it (remove it if it is "
                            "not yours)") from None
        raise ZayaError(f"{path}: cannot create the directory's lock file ({os_reason(exc)})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else "a hard link to another file"
        raise ZayaError(f"{path}: the lock file is {kind}; refusing to use it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+", encoding="utf-8", errors="replace")


def _same_file(path: Path, handle) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    mine = os.fstat(handle.fileno())
    return (info.st_ino, info.st_dev) == (mine.st_ino, mine.st_dev)


def _record(handle) -> dict | None:
    """The holder's record in a lock file, or None if it holds something else."""
    handle.seek(0)
    try:
        info = json.loads(handle.read(4096) or "{}")
    except ValueError:
        return None
    if not isinstance(info, dict) or not {"pid", "host", "what", "since"} <= info.keys():
        return None
    return info


def _holder(handle) -> str:
    info = _record(handle)
    if info is None:
        return "another process"
    fields = {k: str(info[k])[:100] for k in ("what", "pid", "host", "since")}
    return f"{fields['what']} (pid {fields['pid']} on host {fields['host']}, since {fields['since']})"
