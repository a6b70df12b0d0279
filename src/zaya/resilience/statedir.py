"""The supervisor's state directory: the files zaya keeps there, and the checks that what it finds there is its own.

The directory is shared by the supervisors of a job's nodes and read at every poll, so anything may have been
planted in it: a link, a FIFO, a device, a file of the wrong shape. zaya

- makes each directory of its layout itself (`heartbeats/NODE/run-N`, `logs/NODE`) and follows no link there:
  a component that is a link or not a directory is one line before the group starts;
- writes a file only if it is a regular file, opened without following a link and without blocking
  (`open_append`), or by renaming a temporary file it created exclusively under a name of its own process;
- removes only the heartbeat files it recognises by name and kind (`clear_beats`), never a directory;
- reads `cordon.json` as a document (a regular file within 16 MiB, nested at most 64 deep) with typed fields
  (`read_cordon`): a node names up to 65,536 nodes and GPU indices in 0..65,535.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import os_reason, parse_json, read_bytes
from zaya.resilience.heartbeat import BEAT_NAME, TMP_NAME
from zaya.run_dir import append_fd
from zaya.schema import Fields, shown

CORDON_FILE = "cordon.json"
MAX_CORDONED = 65536  # nodes, or GPU indices of one node, in a cordon file
MAX_GPU = 65535


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "not a file"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot use it ({os_reason(exc)})") from None


def check_file(path: Path, what: str) -> None:
    """Refuse `path` unless it is absent or a regular file (not a link to one)."""
    found = _lstat(path)
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise ZayaError(f"{path}: {file_kind(found.st_mode)}, not a regular file; {what} must be one (zaya writes "
                        "its state directory's files itself and through nothing else)")


def make_dirs(root: Path, *parts: str) -> Path:
    """`root/parts...`, each directory below `root` made here if absent and refused if it is a link or not a
    directory."""
    path = root
    for part in parts:
        path = path / part
        found = _lstat(path)
        if found is None:
            try:
                path.mkdir(exist_ok=True)
            except OSError as exc:
                raise ZayaError(f"{path}: cannot make the directory ({os_reason(exc)})") from None
            found = _lstat(path)
        if found is None or not stat.S_ISDIR(found.st_mode):
            kind = file_kind(found.st_mode) if found is not None else "gone"
            raise ZayaError(f"{path}: {kind}, not a directory; zaya makes this directory of its state directory "
                            "itself and follows no link there")
    return path


def open_append(path: Path, what: str) -> int:
    """A descriptor appending to the regular file `path` (made if absent); a link, FIFO, device or directory there
    is one line, and the open never blocks."""
    check_file(path, what)
    try:
        return append_fd(path)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot write {what} ({os_reason(exc)})") from None


def clear_beats(directory: Path) -> None:
    """Remove the heartbeat files an earlier run of this state directory left in `directory` (they would look
    hung), and nothing else: regular files named as zaya names them (`rank-N.json`, a writer's temporary file)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if BEAT_NAME.fullmatch(entry.name) is None and TMP_NAME.fullmatch(entry.name) is None:
                continue
            if entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def read_cordon(path: Path) -> dict:
    """`{"gpus": {node: [index, ...]}, "nodes": [node, ...]}` from the cordon file (empty when there is none); a
    file that is not one is one `ZayaError` naming it and the field."""
    try:
        data = parse_json(read_bytes(path, "document", "a cordon file", follow_links=False), path)
    except ZayaError:
        if _lstat(path) is None:
            return {"gpus": {}, "nodes": []}
        raise
    doc = Fields(data, path)
    nodes = doc.list("nodes", default=[], of=str, max_len=MAX_CORDONED)
    gpus = doc.dict("gpus", default={}, of=list)
    if len(gpus) > MAX_CORDONED:
        raise ZayaError(f"{path}: field 'gpus' names more than {MAX_CORDONED:,} nodes")
    for node, indices in gpus.items():
        if len(indices) > MAX_CORDONED:
            raise ZayaError(f"{path}: field 'gpus.{node}' lists more than {MAX_CORDONED:,} GPUs")
        for i, index in enumerate(indices):
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_GPU:
                raise ZayaError(f"{path}: field 'gpus.{node}.{i}' must be a GPU index (an integer in "
                                f"0..{MAX_GPU:,}), got {shown(index)}")
    return {"gpus": {node: list(indices) for node, indices in gpus.items()}, "nodes": list(nodes)}


def write_cordon(path: Path, data: dict) -> None:
    """Replace the cordon file by renaming a temporary file made for this write alone (never written through)."""
    check_file(path, "the cordon file")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
