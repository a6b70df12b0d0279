"""What zaya may destroy: only what it can prove it made. An output is written into a staging directory of its own
(`Staging`), whose name carries this process's pid and a random token and which holds a marker file saying who
made it and for what; the output is renamed into place when complete. A staging directory left by a killed
process is removed later only if its marker says zaya made it for the same output (`remove_stale_staging`),
never by a name pattern alone; anything else is left alone, whatever it is called.

A file output (`write_output`) replaces an existing file only when asked (`--overwrite`), and never anything but
a regular file: a link, FIFO, device or directory in its place is refused. Its temporary file is made with
`O_EXCL | O_NOFOLLOW` in the same directory and renamed over the target.

SIGTERM, like Ctrl-C, unwinds the command (`interrupt_on_sigterm`), so that the `finally` blocks of a build, a
convert or an export remove their staging and let go of their lock before the process exits.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import time
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import os_reason

MARKER = ".zaya-staging.json"
_INNER = "new"  # the output inside its staging directory, renamed into place on commit
_REPLACED = "replaced"  # the output it replaces, moved aside for the moment of the swap
_NAME_PART = 96  # characters of the output's name kept in a staging name (the whole name would be too long)


def staging_prefix(target: Path) -> str:
    return f".{target.name[:_NAME_PART]}.zaya-"


class Staging:
    """A directory beside `target` in which an output is made whole, then renamed to `target` (`commit`); if the
    block ends any other way it is removed, and nothing else is. `what` names the writer in its marker.

        with Staging(out, "zaya data build") as staging:
            write_everything(staging.path)
            staging.commit(replace=overwrite)
    """

    def __init__(self, target: Path | str, what: str):
        self.target, self.what = Path(target), what
        self.root = self.target.parent / f"{staging_prefix(self.target)}{os.getpid()}-{secrets.token_hex(6)}"
        self.committed = False

    @property
    def path(self) -> Path:
        """Where the output is written."""
        return self.root / _INNER

    def __enter__(self) -> Staging:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.root.mkdir()  # honours the umask, unlike mkdtemp: the output gets ordinary permissions
        except OSError as exc:
            raise ZayaError(f"{self.target}: cannot create ({os_reason(exc)})") from None
        try:
            _write_marker(self.root, {"for": self.target.name, "what": self.what, "pid": os.getpid(),
                                      "host": socket.gethostname(), "token": self.root.name.rsplit("-", 1)[1],
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        return self

    def commit(self, replace: bool = False) -> None:
        """Rename the output into place. With `replace`, an existing `target` (which the caller has proved is one
        of zaya's outputs) is swapped out and removed; otherwise an existing `target` is refused."""
        target, new = self.target, self.path
        if not (target.exists() or target.is_symlink()):
            os.rename(new, target)
        elif not replace:
            raise ZayaError(f"{target}: already exists; refusing to overwrite")
        else:
            os.rename(target, self.root / _REPLACED)
            try:
                os.rename(new, target)
            except BaseException:
                os.rename(self.root / _REPLACED, target)
                raise
        self.committed = True
        with contextlib.suppress(OSError):
            fsync_dir(target.parent)

    def __exit__(self, *exc) -> None:
        # a swap interrupted between its two renames would leave no `target`: put the old one back first
        replaced = self.root / _REPLACED
        if replaced.exists() and not (self.target.exists() or self.target.is_symlink()):
            os.rename(replaced, self.target)
        shutil.rmtree(self.root, ignore_errors=True)


def _write_marker(directory: Path, record: dict) -> None:
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle)


def _marker(directory: Path) -> dict | None:
    """The marker of a staging directory zaya made, or None for anything else (no marker, a link, garbage)."""
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode):
            return None
        fd = os.open(directory / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        text = handle.read(4097)
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("token"), str) or not isinstance(
            record.get("pid"), int) or not isinstance(record.get("for"), str):
        return None
    if not directory.name.endswith(f"{record['pid']}-{record['token']}"):
        return None
    return record


def remove_stale_staging(target: Path | str, *, locked: bool) -> list[Path]:
    """Remove the staging directories that earlier zaya processes made for `target` and left behind (killed before
    they could clean up), and return them. `locked`: the caller holds `target`'s lock, so no other writer is alive
    and every one found is stale; otherwise only those of this host whose process has gone are. A staging
    directory holding a replaced output whose swap was cut short gives it back first, if `target` is missing."""
    target = Path(target)
    removed = []
    try:
        candidates = list(target.parent.glob(f"{glob_escape(staging_prefix(target))}*"))
    except OSError:
        return removed
    for candidate in candidates:
        record = _marker(candidate)
        if record is None or record["for"] != target.name:
            continue
        if not locked and (record.get("host") != socket.gethostname() or _alive(record["pid"])):
            continue
        replaced = candidate / _REPLACED
        if replaced.exists() and not (target.exists() or target.is_symlink()):
            os.rename(replaced, target)
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# ---- single files -------------------------------------------------------------------------------------


def check_output(path: Path | str, overwrite: bool, flag: str = "--overwrite") -> None:
    """Refuse, before any work, an output file that exists (without `overwrite`) or that is not a regular file
    (a link, FIFO, device or directory: never replaced)."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ZayaError(f"{path}: cannot write ({os_reason(exc)})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise ZayaError(f"{path}: exists and is {kind}; refusing to replace it")
    if not overwrite:
        raise ZayaError(f"{path}: already exists; pass {flag} to replace it")


def write_output(path: Path | str, data: str | bytes, overwrite: bool, flag: str = "--overwrite") -> None:
    """Write the file `path` whole or not at all (a temporary file of this process's, renamed over it), after
    `check_output`; errors name `path`."""
    path = Path(path)
    check_output(path, overwrite, flag)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.parent / f".{path.name[:_NAME_PART]}.zaya-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise _write_error(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        check_output(path, overwrite, flag)  # again: something may have appeared there meanwhile
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _write_error(path, exc) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_error(path: Path, exc: OSError) -> BaseException:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        return OSError(exc.errno, exc.strerror, str(path))  # a storage error: the CLI names it in one line
    return ZayaError(f"{path}: cannot write ({os_reason(exc)})")


def fsync_dir(directory: Path | str) -> None:
    """Make a rename or a new file in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_parent(path: Path | str) -> None:
    """Create the directories above an output file; one line if they cannot be."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ZayaError(f"{path}: cannot write (a parent is not a directory)") from None
    except OSError as exc:
        raise _write_error(path, exc) from None


# ---- signals ------------------------------------------------------------------------------------------


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM (see `interrupt_on_sigterm`): it unwinds like Ctrl-C's
    KeyboardInterrupt, so that what a command made for itself is removed on the way out."""


def interrupt_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread with `Terminated` (exit 143) instead of ending the process where it
    stands; a second SIGTERM during the unwinding is ignored, so that the clean-up finishes. Commands that answer
    SIGTERM otherwise (training, the supervisor) install their own handler over this one while they run."""

    def on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(128 + signal.SIGTERM)

    with contextlib.suppress(ValueError):  # not the main thread: nothing to unwind
        signal.signal(signal.SIGTERM, on_sigterm)
