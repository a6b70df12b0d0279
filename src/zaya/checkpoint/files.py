"""The files of a checkpoint directory, and how they are read and checked without trusting them.

    step_00000100/
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
  every rank's.
- JSON files are written and fsynced before the directory is renamed into place; page-cache hints warm a
  checkpoint before it is loaded (or drop it, to measure a cold start).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from zaya.errors import ZayaError

FORMAT = "zaya-checkpoint"
# 2: optimizer state keyed by parameter name (any world size resumes it); 1: by parameter index. The model
# weights of both load alike.
VERSION = 2
MODEL_VERSIONS = (1, 2)
INFO_FILE = "zaya.json"
METADATA_FILE = ".metadata"
TRAIN_STATE_FILE = "train_state.json"
LATEST_FILE = "latest"


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint (its info file and DCP's index), committed or not."""
    return (Path(directory) / INFO_FILE).is_file() and (Path(directory) / METADATA_FILE).is_file()


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
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except Exception as exc:
        raise ZayaError(f"{path}: refused to load checkpoint metadata ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise ZayaError(f"{path}: not a checkpoint metadata object")
    unsafe = [fqn for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)]
    if unsafe:
        raise ZayaError(f"{path}: entry '{unsafe[0]}' is a pickled object; only tensors are loaded")
    inside = Path(directory).resolve()
    for storage in (metadata.storage_data or {}).values():
        relative = getattr(storage, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).is_absolute() or not (
                inside / relative).resolve().is_relative_to(inside):
            raise ZayaError(f"{path}: storage path {relative!r} lies outside the checkpoint")
    return metadata


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
    crc = 0
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
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


MAX_WORLD_SIZE = 1 << 20  # ranks a checkpoint may say it was written by


def verify_checkpoint(directory: Path) -> None:
    """Raise `ZayaError` naming the first manifest or file that is missing, truncated or altered."""
    directory = Path(directory)
    info = read_json(directory / INFO_FILE)
    world_size = info.get("world_size", 1)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ZayaError(f"{directory / INFO_FILE}: field 'world_size' must be an integer in 1..{MAX_WORLD_SIZE}, "
                        f"got {world_size!r}")
    inside = directory.resolve()
    for rank in range(world_size):
        manifest_path = directory / manifest_name(rank)
        files = read_json(manifest_path).get("files")
        if not isinstance(files, dict):
            raise ZayaError(f"{manifest_path}: missing field 'files'")
        for name, entry in files.items():
            path = directory / name
            if Path(name).is_absolute() or not path.resolve().is_relative_to(inside):
                raise ZayaError(f"{manifest_path}: lists {name!r}, a path outside the checkpoint")
            if not isinstance(entry, dict):
                raise ZayaError(f"{manifest_path}: the entry of {name!r} is not an object")
            if not path.is_file():
                raise ZayaError(f"{path}: listed in {manifest_path.name} but missing")
            if path.stat().st_size != entry.get("bytes"):
                raise ZayaError(f"{path}: size {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
            if file_checksum(path) != entry.get("crc32"):
                raise ZayaError(f"{path}: checksum does not match {manifest_path.name}")


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
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                if flush:
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, getattr(os, advice))
            finally:
                os.close(fd)


# ---- small helpers ------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ZayaError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ZayaError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ZayaError(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: dict) -> None:
    """Write JSON and fsync it (callers rename or commit the directory afterwards)."""
    with Path(path).open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def fresh_staging(directory: Path) -> Path:
    """The staging directory `directory.tmp`, made anew, for an output that appears whole under `directory`
    (renamed into place) or not at all; refuses a `directory` that exists."""
    directory = Path(directory)
    if directory.exists():
        raise ZayaError(f"{directory}: already exists; refusing to overwrite")
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
