"""Reading a file zaya did not write as zaya would check any input: it must be a regular file (a FIFO, socket or
device would block or never end), no larger than the cap for its kind, and text must be UTF-8; JSON and TOML are
parsed with a bound on their nesting. Every failure is one `ZayaError` naming the file and what is wrong.

The caps, by kind (docs/hardening.md lists them):

    pointer      4 KiB     a checkpoint's `latest`
    heartbeat   64 KiB     a worker's heartbeat file
    template     1 MiB     a chat template
    config       4 MiB     a TOML run config, a policy, an HF config.json, a lock's holder
    document    16 MiB     zaya's own JSON files: zaya.json, train_state.json, a checkpoint manifest, a cordon or
                           incident file, a tokenizer_config.json
    manifest    64 MiB     a dataset's manifest, a measured GEMM table, a device table
    tokenizer  256 MiB     a tokenizer.json
    log          read line by line, each line cut at 64 KiB (`bounded_lines`): never whole

A line-oriented reader (`bounded_lines`) cuts lines at a length bound instead of holding them whole, for logs and
worker output that may hold anything.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import tomllib

from zaya.errors import ZayaError

KiB, MiB = 1 << 10, 1 << 20
# "kept": what zaya keeps for itself beside a run (a calibration, a layout chosen at launch)
CAPS = {"pointer": 4 * KiB, "heartbeat": 64 * KiB, "template": MiB, "kept": MiB, "config": 4 * MiB,
        "document": 16 * MiB, "manifest": 64 * MiB, "tokenizer": 256 * MiB}
LINE_CAP = 64 * KiB  # a log line longer than this is cut (`bounded_lines`)
MAX_DEPTH = 64  # nesting of a JSON or TOML document: zaya's own go 5 deep; a chat's messages a few more


def size_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


def os_reason(exc: OSError) -> str:
    """What the operating system said, in a few lowercase words."""
    if exc.errno == errno.ELOOP:
        return "a loop of symbolic links"
    if exc.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return (exc.strerror or str(exc)).lower()


def open_regular(path: Path | str, what: str = "file", *, follow_links: bool = True) -> BinaryIO:
    """`path` opened for reading, if it is a regular file; otherwise one `ZayaError`. The open never blocks (a FIFO
    with no writer would hold it forever): it is made non-blocking and checked before anything is read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise ZayaError(f"{path}: a symbolic link; {what} must be a regular file") from None
        raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ZayaError(f"{path}: {_kind(mode)}, not a regular file; {what} must be one")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def read_bytes(path: Path | str, kind: str, what: str | None = None, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `CAPS[kind]` of them; `what` names it in messages."""
    cap, what = CAPS[kind], what or f"a {kind} file"
    with open_regular(path, what, follow_links=follow_links) as handle:
        try:
            data = handle.read(cap + 1)
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    if len(data) > cap:
        raise ZayaError(f"{path}: larger than {size_text(cap)}, the limit for {what}")
    return data


def decode_text(data: bytes, path: Path | str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ZayaError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def read_text(path: Path | str, kind: str, what: str | None = None, *, follow_links: bool = True) -> str:
    """The UTF-8 text of the regular file `path`, within the cap for its kind."""
    return decode_text(read_bytes(path, kind, what, follow_links=follow_links), path)


def parse_json(text: str | bytes, source: Path | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON document from `source` (named in messages), no deeper than `max_depth`."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ZayaError(f"{source}: not valid JSON (nested more than {max_depth} deep)") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of too many digits
        raise ZayaError(f"{source}: not valid JSON ({_first_line(exc)})") from None
    check_depth(data, source, max_depth)
    return data


def read_json(path: Path | str, kind: str = "document", what: str | None = None, *, follow_links: bool = True,
              max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in the regular file `path`, within the cap for its kind and `max_depth`."""
    return parse_json(read_text(path, kind, what, follow_links=follow_links), path, max_depth=max_depth)


def read_json_object(path: Path | str, kind: str = "document", what: str | None = None) -> dict:
    """As `read_json`, for a document that must be a JSON object."""
    data = read_json(path, kind, what)
    if not isinstance(data, dict):
        raise ZayaError(f"{path}: expected a JSON object, got {_json_type(data)}")
    return data


def read_toml(path: Path | str, kind: str = "config", what: str | None = None) -> dict:
    """The TOML document in the regular file `path`, within the cap for its kind and `MAX_DEPTH`."""
    text = read_text(path, kind, what)
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ZayaError(f"{path}: not valid TOML (nested more than {MAX_DEPTH} deep)") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ZayaError(f"{path}: not valid TOML ({_first_line(exc)})") from None
    check_depth(data, path, MAX_DEPTH)
    return data


def check_depth(data: Any, source: Path | str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a document nested deeper than `max_depth` (readers that walk it recursively would overflow)."""
    todo = [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise ZayaError(f"{source}: nested more than {max_depth} deep")
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def bounded_lines(handle: BinaryIO, max_line: int = LINE_CAP, chunk: int = 1 << 16) -> Iterator[bytes]:
    """The lines of a binary stream, each without its newline and cut to `max_line` bytes (the rest of an
    over-long line is skipped as it is read, never held): a log or a worker's output may hold anything."""
    partial = b""
    skipping = False
    while True:
        block = handle.read(chunk)
        if not block:
            break
        start = 0
        while True:
            end = block.find(b"\n", start)
            if end < 0:
                if not skipping:
                    partial += block[start:]
                    if len(partial) > max_line:
                        partial, skipping = partial[:max_line], True
                break
            if not skipping:
                partial += block[start:end]
            yield partial[:max_line]
            partial, skipping, start = b"", False, end + 1
    if partial or skipping:
        yield partial[:max_line]


def read_lines(path: Path | str, what: str = "a log", max_line: int = LINE_CAP) -> Iterator[str]:
    """The lines of the regular file `path` as text (undecodable bytes replaced), each cut to `max_line` bytes."""
    with open_regular(path, what) as handle:
        try:
            for line in bounded_lines(handle, max_line):
                yield line.decode("utf-8", errors="replace").rstrip("\r")
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true or false", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
