"""Reading what the probes watch without trusting it: sysfs files and the output of read-only commands. A failed
read raises `ReadError`, whose message the poll records in its `last_error`; the poll itself never raises."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ReadError(f"{path}: {exc.strerror or exc}") from None


@dataclass
class Output:
    returncode: int
    stdout: str
    stderr: str

    def first_line(self) -> str:
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if line.strip():
                return line.strip()
        return "no output"


def run_command(argv: list[str], timeout_s: float) -> Output:
    """Run a read-only command; `ReadError` when it cannot start or runs past `timeout_s`.

    It runs in a session of its own so that a timeout kills everything it started: a wrapper script's child
    would otherwise keep the pipes open and hold the supervisor past the timeout."""
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        raise ReadError(f"{argv[0]}: {exc.strerror or exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise ReadError(f"{argv[0]}: no answer within {timeout_s:g} s") from None
    return Output(proc.returncode, stdout, stderr)


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ReadError(f"{path}: expected an integer, got {text[:40]!r}") from None
