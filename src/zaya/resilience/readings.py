"""Reading what the probes watch without trusting it: sysfs files and the output of read-only commands. A failed
read raises `ReadError`, whose message the poll records in its `last_error`; the poll itself never raises.

Nothing here blocks or grows without a bound: a sysfs file is opened without blocking and read only if it is a
regular file, at most `FILE_CAP` of it; a command's output is read as it comes, at most `OUTPUT_CAP` of it, and
the command is killed (with everything it started) past its timeout or that cap.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zaya.reading import MiB, os_reason, size_text

FILE_CAP = MiB  # a sysfs attribute (the longest, gpu_vram_bad_pages, lists a few thousand pages)
OUTPUT_CAP = 16 * MiB  # a probe command's output, or the kernel log (its ring buffer is at most a few MiB)
COUNTER_BOUND = 1 << 64  # a sysfs or tool counter is an unsigned 64-bit value at most


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ReadError(Exception):
    """A command or file could not be read; the poll records the message in `last_error`."""


def shown(root: Path, path: Path) -> str:
    """`path` as it is on a real machine: without the root prefix, which only tests set."""
    try:
        return "/" + path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def read_text(path: Path) -> str | None:
    """The stripped text of a sysfs file, None when it does not exist; other errors raise `ReadError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ReadError(f"{path}: {os_reason(exc)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ReadError(f"{path}: not a regular file")
        data = os.read(fd, FILE_CAP + 1)
    except OSError as exc:
        raise ReadError(f"{path}: {os_reason(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > FILE_CAP:
        raise ReadError(f"{path}: larger than {size_text(FILE_CAP)}")
    return data.decode("utf-8", errors="replace").strip()


@dataclass
class Output:
    returncode: int
    stdout: str
    stderr: str

    def first_line(self) -> str:
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if line.strip():
                return line.strip()[:200]
        return "no output"


def run_command(argv: list[str], timeout_s: float, max_bytes: int = OUTPUT_CAP) -> Output:
    """Run a read-only command; `ReadError` when it cannot start, runs past `timeout_s` or prints more than
    `max_bytes` in all.

    It runs in a session of its own so that a timeout kills everything it started: a wrapper script's child
    would otherwise keep the pipes open and hold the supervisor past the timeout."""
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
    except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument
        raise ReadError(f"{argv[0][:200]}: {os_reason(exc) if isinstance(exc, OSError) else exc}") from None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    deadline, total, failure = time.monotonic() + timeout_s, 0, None
    with selectors.DefaultSelector() as selector:
        for stream in (proc.stdout, proc.stderr):
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = f"no answer within {timeout_s:g} s"
                break
            for key, _ in selector.select(min(left, 1.0)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                total += len(data)
                if total > max_bytes:
                    failure = f"more than {size_text(max_bytes)} of output"
                    break
                chunks[key.fd].append(data)
    if failure is None:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            failure = f"no answer within {timeout_s:g} s"
    if failure is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if failure is not None:
        raise ReadError(f"{argv[0][:200]}: {failure}")
    out, err = b"".join(chunks[out_fd]), b"".join(chunks[err_fd])
    return Output(proc.returncode, out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace"))


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 20) or int(text) >= COUNTER_BOUND:
        raise ReadError(f"{path}: expected a counter (an integer in 0..2**64), got {text[:40]!r}")
    return int(text)
