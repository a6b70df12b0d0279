"""The files of a checkpoint directory, and how they are read and checked without trusting them.

    step_00000100/
        .zaya-step.json              zaya's marker, written first: the directory is zaya's to remove or rename
        .metadata, __R_*.distcp      torch.distributed.checkpoint: every rank writes its own shards
        zaya.json                    format, version, model config, dtype, precision, world size
        train_state.json             step, phase, consumed samples, data fingerprints, loader and optimizer
                                     settings: every non-tensor piece of state, as JSON
        rng.rankR.json               each rank's random-number-generator states
        manifest.rankR.json          each rank's files with their sizes and CRC-32 checksums
        tokenizer.json               optional, so that the checkpoint can generate text on its own

- `.metadata` is DCP's index, a pickle: it is read by an unpickler that admits only the checkpoint-metadata
  types, and entries that DCP would unpickle (non-tensor "bytes" items) are refused (`read_metadata`,
  `SafeReader` for `dcp.load`).
- `manifest.rankR.json` records the size and CRC-32 of each file rank R wrote; `verify_checkpoint` checks
  every rank's, and that together they list every file of the directory and every file the DCP index names.
- Every JSON file is read through `zaya.reading` (a regular file, a size cap, a depth bound) and its fields
  through `zaya.schema.Fields`: a wrong one is one line naming the file and the key.
- zaya removes or renames a checkpoint directory only when it can prove it made it (`zaya_made`): its marker
  names it, or its info file has zaya's format. A link is never zaya's.
- JSON files are written and fsynced before the directory is renamed into place; page-cache hints warm a
  checkpoint before it is loaded (or drop it, to measure a cold start).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import secrets
import socket
import stat
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from zaya import reading
from zaya.errors import STORAGE_ERRNOS, ZayaError, storage_error
from zaya.reading import os_reason
from zaya.schema import Fields, shown

FORMAT = "zaya-checkpoint"
# 2: optimizer state keyed by parameter name (any world size resumes it); 1: by parameter index. The model
# weights of both load alike.
VERSION = 2
MODEL_VERSIONS = (1, 2)
INFO_FILE = "zaya.json"
METADATA_FILE = ".metadata"
TRAIN_STATE_FILE = "train_state.json"
LATEST_FILE = "latest"
STEP_MARKER = ".zaya-step.json"  # written first into each step directory zaya makes
_MARKER_FORMAT = "zaya-checkpoint-directory"
# DCP's index of a checkpoint: about 260 bytes per tensor shard, so a model of thousands of tensors written by a
# few hundred ranks is a few hundred MB; a larger file is refused before anything is read
METADATA_CAP = 1 << 30
MAX_WORLD_SIZE = 1 << 20  # ranks a checkpoint may say it was written by


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint (its info file and DCP's index), committed or not."""
    return _regular(Path(directory) / INFO_FILE) and _regular(Path(directory) / METADATA_FILE)


def _regular(path: Path, follow_links: bool = True) -> bool:
    try:
        return stat.S_ISREG((os.stat if follow_links else os.lstat)(path).st_mode)
    except (OSError, ValueError):
        return False


def output_exists(path: Path) -> bool:
    """Whether anything (a link included) is at the output path `path`; a path that cannot be looked at (a name
    too long, a loop of links, no permission) is one `ZayaError` naming it, before any work is done."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise ZayaError(f"{path}: cannot write there ({os_reason(exc)})") from None
    except ValueError:
        raise ZayaError(f"{path}: not a usable path (a NUL character)") from None
    return True


def real_directory(path: Path) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


# ---- ownership ----------------------------------------------------------------------------------------


def write_step_marker(directory: Path) -> None:
    """Mark `directory` (just made, empty) as zaya's step directory; the marker stays with it when it is committed
    and is listed in rank 0's manifest like any other file."""
    directory = Path(directory)
    record = {"format": _MARKER_FORMAT, "for": directory.name.removesuffix(".tmp"), "pid": os.getpid(),
              "host": socket.gethostname(), "token": secrets.token_hex(6)}
    fd = os.open(directory / STEP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _has_step_marker(directory: Path) -> bool:
    try:
        data = reading.read_json(directory / STEP_MARKER, "pointer", "a checkpoint's marker", follow_links=False)
    except ZayaError:
        return False
    return isinstance(data, dict) and data.get("format") == _MARKER_FORMAT and isinstance(
        data.get("token"), str) and data.get("for") == directory.name.removesuffix(".tmp")


def is_zaya_checkpoint(directory: Path) -> bool:
    """Whether `directory` is, provably, a checkpoint zaya wrote: a directory (not a link) whose info file (not a
    link) says zaya's format, beside DCP's index."""
    directory = Path(directory)
    if not real_directory(directory) or not _regular(directory / METADATA_FILE, follow_links=False):
        return False
    try:
        info = reading.read_json(directory / INFO_FILE, "document", follow_links=False)
    except ZayaError:
        return False
    return isinstance(info, dict) and info.get("format") == FORMAT


def zaya_made(directory: Path) -> bool:
    """Whether zaya made the step directory `directory` (a `step_N` or a `step_N.tmp`), and so may remove or rename
    it: a directory, not a link, holding zaya's marker for its name, or (a checkpoint written before markers)
    zaya's info file."""
    directory = Path(directory)
    return real_directory(directory) and (_has_step_marker(directory) or is_zaya_checkpoint(directory))


# ---- a .metadata reader that cannot run code ----------------------------------------------------------

_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def read_metadata(directory: Path) -> Metadata:
    """DCP metadata of `directory`, unpickled with only the checkpoint-metadata types admitted."""
    path = Path(directory) / METADATA_FILE
    with reading.open_regular(path, "a checkpoint's metadata") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > METADATA_CAP:
            raise ZayaError(f"{path}: larger than {reading.size_text(METADATA_CAP)}, the limit for a checkpoint's "
                            "metadata")
        try:  # read as it is unpickled: garbage stops at its first bad byte, not after the whole file is read
            metadata = _MetadataUnpickler(handle).load()
        except RecursionError:
            raise ZayaError(f"{path}: refused to load checkpoint metadata (nested too deeply)") from None
        except Exception as exc:
            raise ZayaError(f"{path}: refused to load checkpoint metadata ({_first_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ZayaError(f"{path}: not a checkpoint metadata object")
    unsafe = [fqn for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)]
    if unsafe:
        raise ZayaError(f"{path}: entry '{unsafe[0]}' is a pickled object; only tensors are loaded")
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise ZayaError(f"{path}: not a checkpoint metadata object")
    for name in sorted(set(storage_files(metadata, path))):
        inside_checkpoint(Path(directory), name, path)
    return metadata


def storage_files(metadata: Metadata, source: Path) -> list[str]:
    """The files (paths relative to the checkpoint) that DCP's metadata says hold its tensors."""
    names = []
    for item in (metadata.storage_data or {}).values():
        relative = getattr(item, "relative_path", None)
        if not isinstance(relative, str):
            raise ZayaError(f"{source}: storage path {relative!r} is not a file name")
        names.append(relative)
    return names


def inside_checkpoint(directory: Path, name: str, source: Path) -> Path:
    """`directory / name`, refused (naming `source`, the file that names it) unless it stays inside `directory`,
    links resolved: a manifest or an index must not make a reader open files elsewhere."""
    inside = os.path.realpath(directory)
    path = Path(directory) / name
    if not name or "\0" in name or Path(name).is_absolute() or not _within(os.path.realpath(path), inside):
        raise ZayaError(f"{source}: storage path {shown(name)} lies outside the checkpoint")
    return path


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class SafeReader(FileSystemReader):
    """A DCP filesystem reader whose metadata goes through `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- manifests ----------------------------------------------------------------------------------------


def file_checksum(path: Path) -> str:
    """CRC-32 of a file, as 8 hex digits: it catches truncation and flipped bits, and at several GB/s it keeps
    a checkpoint's save and verification close to the disk's own speed (a cryptographic hash halves it)."""
    with reading.open_regular(path, "a checkpoint's file") as handle:
        return _crc(handle, path)


def _crc(handle, path: Path) -> str:
    crc = 0
    try:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    except OSError as exc:
        if errno.errorcode.get(exc.errno) in STORAGE_ERRNOS:
            raise
        raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    return f"{crc:08x}"


def manifest_name(rank: int) -> str:
    return f"manifest.rank{rank}.json"


def write_manifest(directory: Path, rank: int, names: Iterable[str]) -> None:
    """Record the size and CRC-32 of the files `names` (this rank's) in `manifest.rankR.json`, fsynced."""
    files = {}
    for name in sorted(names):
        path = directory / name
        files[name] = {"bytes": path.stat().st_size, "crc32": file_checksum(path)}
    write_json(directory / manifest_name(rank), {"rank": rank, "files": files})


def verify_checkpoint(directory: Path) -> None:
    """Raise `ZayaError` naming the first file that is missing, truncated, altered or unaccounted for: every
    manifest's files must match their sizes and checksums, and the manifests together must list every file of
    the directory (besides themselves) and every file DCP's metadata names."""
    directory = Path(directory)
    info = Fields(read_json(directory / INFO_FILE), directory / INFO_FILE)
    world_size = info.int("world_size", 1, lo=1, hi=MAX_WORLD_SIZE)
    manifests = {manifest_name(rank) for rank in range(world_size)}
    listed: set[str] = set()
    for rank in range(world_size):
        manifest_path = directory / manifest_name(rank)
        files = Fields(read_json(manifest_path), manifest_path).obj("files")
        for name in files.data:
            entry = files.obj(name)
            size, crc = entry.int("bytes", lo=0), entry.str("crc32", max_len=8)
            path = _listed_path(directory, name, manifest_path)
            with reading.open_regular(path, f"a file listed in {manifest_path.name}") as handle:
                actual = os.fstat(handle.fileno()).st_size
                if actual != size:
                    raise ZayaError(f"{path}: size {actual} bytes, the manifest says {size}")
                if _crc(handle, path) != crc:
                    raise ZayaError(f"{path}: checksum does not match {manifest_path.name}")
            listed.add(os.path.normpath(name))
    for name in (INFO_FILE, METADATA_FILE):
        if name not in listed:
            raise ZayaError(f"{directory / name}: not listed in any manifest (manifest.rank*.json)")
    for name in sorted(set(storage_files(read_metadata(directory), directory / METADATA_FILE))):
        if os.path.normpath(name) not in listed:
            where = "missing" if not os.path.lexists(directory / name) else "not listed in any manifest"
            raise ZayaError(f"{directory / name}: named by {METADATA_FILE} but {where}")
    for entry in _entries(directory):
        if entry.name not in manifests and entry.name not in listed and not entry.is_dir(follow_symlinks=False):
            raise ZayaError(f"{directory / entry.name}: not listed in any manifest (manifest.rank*.json)")


def _listed_path(directory: Path, name: str, manifest_path: Path) -> Path:
    try:
        return inside_checkpoint(directory, name, manifest_path)
    except ZayaError:
        raise ZayaError(f"{manifest_path}: lists {shown(name)}, a path outside the checkpoint") from None


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as found:
            return sorted(found, key=lambda e: e.name)
    except OSError as exc:
        raise ZayaError(f"{directory}: cannot list ({os_reason(exc)})") from None


def prewarm(directory: Path) -> None:
    """Ask the kernel to read the checkpoint's files into the page cache ahead of the load (WILLNEED)."""
    _advise(directory, "POSIX_FADV_WILLNEED")


def drop_from_page_cache(directory: Path) -> None:
    """The opposite of `prewarm` (DONTNEED, after flushing), for measuring a cold restart."""
    _advise(directory, "POSIX_FADV_DONTNEED", flush=True)


def _advise(directory: Path, advice: str, flush: bool = False) -> None:
    if not hasattr(os, "posix_fadvise"):  # not on every platform; the hint is only an optimisation
        return
    for path in Path(directory).iterdir():
        if not _regular(path, follow_links=False):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if flush:
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, getattr(os, advice))
        finally:
            os.close(fd)


# ---- small helpers ------------------------------------------------------------------------------------


def read_json(path: Path, kind: str = "document") -> dict:
    """A JSON object zaya wrote into a checkpoint, read as any input: a regular file within the cap for `kind`
    (`zaya.reading`), nested at most 64 deep; anything else is one `ZayaError` naming the file."""
    return reading.read_json_object(path, kind)


def write_json(path: Path, data: dict) -> None:
    """Write JSON into a file of zaya's own making (never through a link) and fsync it (callers rename or commit
    the directory afterwards)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


_INPUT_KINDS = {"tokenizer.json": "tokenizer", "chat_template.jinja": "template"}


def copy_input(source: Path, directory: Path, name: str | None = None) -> Path:
    """Copy a file the user gave (a tokenizer, a chat template, an HF directory's JSON) into `directory`, an output
    being made, as `name` (default: its own): read as any input (a regular file within the cap for its kind,
    `reading.CAPS`), written without following a link. Returns the copy."""
    source = Path(source)
    name = name or source.name
    data = reading.read_bytes(source, _INPUT_KINDS.get(name, "document"))
    target = Path(directory) / name
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return target


@contextlib.contextmanager
def named_as(staging: Path, target: Path) -> Iterator[None]:
    """Errors raised while an output is made in `staging` name `target`, where it would have been: a message that
    names a temporary path tells the user nothing they can act on. A storage error (a full disk, at any depth of
    what raised it) becomes that `OSError`, with the file it names moved to `target`."""
    before, after = str(staging), str(target)

    def moved(text: str | None) -> str:
        return after if not text else text.replace(before, after)

    try:
        yield
    except ZayaError as exc:
        if before not in str(exc):
            raise
        raise ZayaError(moved(str(exc))) from None
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: the staging goes, the command ends
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = storage_error(exc)
        if error is not None:
            raise OSError(error.errno, error.strerror, moved(error.filename and str(error.filename))) from None
        if isinstance(exc, OSError) and exc.filename is not None and before in str(exc.filename):
            raise ZayaError(f"{moved(str(exc.filename))}: cannot write ({os_reason(exc)})") from None
        raise


def plain_storage_error(exc: BaseException, where: Path | None = None) -> OSError | None:
    """The storage error inside `exc` (a full disk, say, deep in DCP's `CheckpointException`, which is not even an
    `Exception`) as a plain `OSError` naming its file (else `where`), for the CLI to say in one line; None if
    there is none or `exc` is already one."""
    error = storage_error(exc)
    if error is None or (error is exc and (error.filename or where is None)):
        return None
    return OSError(error.errno, error.strerror, error.filename or (str(where) if where is not None else None))




def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
