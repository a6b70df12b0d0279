"""The project's checkpoint format: a directory holding a `torch.distributed.checkpoint` (DCP) of the state,
the model config as JSON, and a manifest of every file's size and SHA-256.

    step_000100/
        .metadata, __0_0.distcp, ...   DCP: every rank writes its own shards
        zaya.json                      {"format": "zaya-checkpoint", "version": 1, "model": {...}, "dtype": ...}
        manifest.json                  {"files": {name: {"bytes": n, "sha256": hex}}}

Loading never executes code from a checkpoint: DCP's `.metadata` is a pickle, so it is read by an unpickler
that admits only the checkpoint-metadata types, and entries DCP would unpickle (non-tensor "bytes" items)
are refused; tensors themselves load with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig

FORMAT = "zaya-checkpoint"
VERSION = 1
CONFIG_FILE = "zaya.json"
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"


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
    path = directory / METADATA_FILE
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
    return metadata


class SafeReader(FileSystemReader):
    """A DCP filesystem reader whose metadata goes through `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- manifest -----------------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record size and SHA-256 of every file of `directory` (except the manifest) and fsync it."""
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": file_digest(path)}
    _write_json(directory / MANIFEST_FILE, {"files": files})


def verify_manifest(directory: Path) -> None:
    """Raise `ZayaError` naming the first file that is missing, truncated or altered."""
    manifest_path = directory / MANIFEST_FILE
    manifest = _read_json(manifest_path)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ZayaError(f"{manifest_path}: missing field 'files'")
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise ZayaError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != entry.get("bytes"):
            raise ZayaError(f"{path}: size {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
        if file_digest(path) != entry.get("sha256"):
            raise ZayaError(f"{path}: checksum does not match the manifest")


# ---- model checkpoints --------------------------------------------------------------------------------


def is_checkpoint(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file() and (directory / METADATA_FILE).is_file()


def read_checkpoint_config(directory: Path) -> tuple[ZayaConfig, dict]:
    """The model config and the whole `zaya.json` of a checkpoint directory."""
    path = directory / CONFIG_FILE
    info = _read_json(path)
    if info.get("format") != FORMAT:
        raise ZayaError(f"{path}: field 'format' must be '{FORMAT}'")
    if info.get("version") != VERSION:
        raise ZayaError(f"{path}: unsupported checkpoint version {info.get('version')!r} (this build reads {VERSION})")
    return ZayaConfig.from_dict(info.get("model"), source=f"{path}: model"), info


def save_model_checkpoint(
    directory: Path, model: torch.nn.Module, config: ZayaConfig, extra_files: Iterable[Path] = ()
) -> None:
    """Write the model's weights as a complete checkpoint into a fresh `directory`, atomically: everything
    goes to `directory.tmp` first, which is renamed into place once its manifest is on disk. `extra_files`
    (a tokenizer, say) are copied in and covered by the manifest."""
    directory = Path(directory)
    if directory.exists():
        raise ZayaError(f"{directory}: already exists; refusing to overwrite")
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        state = {"model": {k: v.detach() for k, v in model.state_dict().items()}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        info = {"format": FORMAT, "version": VERSION, "model": config.to_dict(), "dtype": dtype}
        _write_json(tmp / CONFIG_FILE, info)
        for extra in extra_files:
            shutil.copyfile(extra, tmp / Path(extra).name)
        write_manifest(tmp)
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model_weights(directory: Path, model: torch.nn.Module) -> None:
    """Fill `model` (its state dict keys) from the checkpoint's "model" entries, in place."""
    state = {"model": model.state_dict()}
    metadata = read_metadata(directory)
    missing = [f"model.{k}" for k in state["model"] if f"model.{k}" not in metadata.state_dict_metadata]
    if missing:
        raise ZayaError(f"{directory}: checkpoint lacks tensor '{missing[0]}' ({len(missing)} missing in all)")
    for key, tensor in state["model"].items():
        stored = metadata.state_dict_metadata[f"model.{key}"]
        if tuple(stored.size) != tuple(tensor.shape):
            raise ZayaError(
                f"{directory}: tensor 'model.{key}' has shape {list(stored.size)}, expected {list(tensor.shape)}"
            )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(str(directory)))
    model.load_state_dict(state["model"])


# ---- small helpers ------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ZayaError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ZayaError(f"{path}: expected a JSON object")
    return data


def _write_json(path: Path, data: dict) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
