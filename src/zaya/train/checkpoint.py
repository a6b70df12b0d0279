"""The project's checkpoint format and its commit protocol (system design section 6).

A checkpoint is a directory:

    step_00000100/
        .metadata, __R_*.distcp      torch.distributed.checkpoint: every rank writes its own shards
        zaya.json                    format, version, model config, dtype, world size
        train_state.json             step, phase, consumed samples, data fingerprints, loader and optimizer
                                     settings: every non-tensor piece of state, as JSON
        rng.rankR.json               each rank's random-number-generator states
        manifest.rankR.json          each rank's files with their sizes and CRC-32 checksums
        tokenizer.json               optional, so that the checkpoint can generate text on its own

Commit protocol: everything is written into a fresh `step_N.tmp/`; each rank records its manifest; after a
barrier on a separate gloo control group, rank 0 fsyncs, renames the directory to `step_N/`, atomically
replaces the `latest` pointer and only then deletes the checkpoints beyond the newest `keep`. Loading picks
the newest checkpoint whose manifests validate; a bad one is renamed `*.bad`, never deleted.

Loading never executes code from a checkpoint: DCP's `.metadata` is a pickle, so it is read by an unpickler
that admits only the checkpoint-metadata types, entries that DCP would unpickle (non-tensor "bytes" items)
are refused, and tensors load with `weights_only=True`. Non-tensor state is JSON.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig

FORMAT = "zaya-checkpoint"
# 2: optimizer state keyed by parameter name (any world size resumes it); 1: by parameter index. The model
# weights of both load alike.
VERSION = 2
MODEL_VERSIONS = (1, 2)
CONFIG_FILE = "zaya.json"
TRAIN_STATE_FILE = "train_state.json"
METADATA_FILE = ".metadata"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"step_(\d+)")


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


def verify_checkpoint(directory: Path) -> None:
    """Raise `ZayaError` naming the first manifest or file that is missing, truncated or altered."""
    directory = Path(directory)
    info = read_json(directory / CONFIG_FILE)
    world_size = info.get("world_size", 1)
    for rank in range(world_size):
        manifest_path = directory / manifest_name(rank)
        files = read_json(manifest_path).get("files")
        if not isinstance(files, dict):
            raise ZayaError(f"{manifest_path}: missing field 'files'")
        for name, entry in files.items():
            path = directory / name
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


# ---- random-number generators -------------------------------------------------------------------------


def rng_state() -> dict:
    """The torch (CPU and accelerator) and Python RNG states of this process, as JSON."""
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _python_random_state(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _python_random_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


# ---- model-only checkpoints (`zaya convert`) ----------------------------------------------------------


def is_checkpoint(directory: Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file() and (Path(directory) / METADATA_FILE).is_file()


def read_checkpoint_config(directory: Path) -> tuple[ZayaConfig, dict]:
    """The model config and the whole `zaya.json` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    info = read_json(path)
    if info.get("format") != FORMAT:
        raise ZayaError(f"{path}: field 'format' must be '{FORMAT}'")
    if info.get("version") not in MODEL_VERSIONS:
        raise ZayaError(f"{path}: unsupported checkpoint version {info.get('version')!r} (this build reads "
                        f"{', '.join(map(str, MODEL_VERSIONS))})")
    return ZayaConfig.from_dict(info.get("model"), source=f"{path}: model"), info


def _checkpoint_info(config: ZayaConfig, model: torch.nn.Module, world_size: int) -> dict:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"format": FORMAT, "version": VERSION, "model": config.to_dict(), "dtype": dtype, "world_size": world_size}


def save_model_checkpoint(
    directory: Path, model: torch.nn.Module, config: ZayaConfig, extra_files: Iterable[Path] = ()
) -> None:
    """Write the model's weights as a complete single-process checkpoint into a fresh `directory`, atomically
    (via `directory.tmp`). `extra_files` (a tokenizer, say) are copied in and covered by the manifest."""
    directory = Path(directory)
    if directory.exists():
        raise ZayaError(f"{directory}: already exists; refusing to overwrite")
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _dcp_save({"model": model.state_dict()}, tmp)
        write_json(tmp / CONFIG_FILE, _checkpoint_info(config, model, world_size=1))
        for extra in extra_files:
            shutil.copyfile(extra, tmp / Path(extra).name)
        write_manifest(tmp, 0, [p.name for p in tmp.iterdir() if p.is_file()])
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model_weights(directory: Path, model: torch.nn.Module) -> None:
    """Fill `model` in place from the checkpoint's "model" entries, checking names and shapes first."""
    state = {"model": model.state_dict()}
    load_tensors(directory, state)
    model.load_state_dict(state["model"])


def load_tensors(directory: Path, state: dict, process_group=None) -> None:
    """DCP-load the tensors of `state` (nested dicts of tensors, DTensors included, filled in place),
    checking names and shapes first; in a multi-process job every rank calls it, with `process_group` for
    DCP's own collectives."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    flat = _flatten(state)
    missing = [key for key in flat if key not in metadata.state_dict_metadata]
    if missing:
        raise ZayaError(f"{directory}: checkpoint lacks tensor '{missing[0]}' ({len(missing)} missing in all)")
    for key, tensor in flat.items():
        stored = metadata.state_dict_metadata[key]
        if tuple(stored.size) != tuple(tensor.shape):
            raise ZayaError(f"{directory}: tensor '{key}' has shape {list(stored.size)}, expected {list(tensor.shape)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(str(directory)), process_group=process_group)


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _dcp_save(state: dict, directory: Path, process_group=None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
                 process_group=process_group)


# ---- training checkpoints -----------------------------------------------------------------------------


class CheckpointManager:
    """Saves and finds training checkpoints under `root` with the commit protocol of the module docstring.

    In a multi-process job every rank calls `save` at the same step; the barrier before the commit runs on
    `control_group`, a gloo group of its own, so that it never queues behind training collectives.
    """

    def __init__(self, root: Path, keep: int, rank: int = 0, world_size: int = 1, control_group=None):
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.control_group = control_group
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # -- saving

    def save(
        self,
        step: int,
        tensors: dict,
        train_state: dict,
        info: dict,
        extra_files: Iterable[Path] = (),
        async_save: bool = False,
        on_written: Callable[[], None] | None = None,
        on_commit: Callable[[Path], None] | None = None,
    ) -> None:
        """Write checkpoint `step`. With `async_save`, returns once the tensors are staged in memory; the
        files are written and the checkpoint committed in the background (`latest` moves only then)."""
        self.wait()  # one save in flight at a time
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()

        def finish(future: Future | None) -> None:
            if future is not None:
                future.result()
            self._write_small_files(tmp, train_state, info, extra_files)
            write_manifest(tmp, self.rank, self._own_files(tmp))
            if on_written is not None:
                on_written()
            self._barrier()
            if self.rank == 0:
                self._commit(tmp, final)
                if on_commit is not None:
                    on_commit(final)
            self._barrier()

        if async_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                                        process_group=self.control_group)
            self._pending = threading.Thread(target=self._run_pending, args=(finish, future), daemon=True)
            self._pending.start()
        else:
            _dcp_save(tensors, tmp, self.control_group)
            finish(None)

    def _run_pending(self, finish: Callable[[Future | None], None], future: Future) -> None:
        try:
            finish(future)
        except BaseException as exc:  # surfaced by wait() on the training thread
            self._pending_error = exc

    def wait(self) -> None:
        """Block until an asynchronous save has been committed; re-raise its error, if any."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    def _write_small_files(self, tmp: Path, train_state: dict, info: dict, extra_files: Iterable[Path]) -> None:
        write_json(tmp / f"rng.rank{self.rank}.json", rng_state())
        if self.rank == 0:
            write_json(tmp / TRAIN_STATE_FILE, train_state)
            write_json(tmp / CONFIG_FILE, {**info, "world_size": self.world_size})
            for extra in extra_files:
                shutil.copyfile(extra, tmp / Path(extra).name)

    def _own_files(self, tmp: Path) -> list[str]:
        """This rank's files: its DCP shards and RNG state; rank 0 also owns the shared files."""
        names = []
        for path in tmp.iterdir():
            if not path.is_file() or path.name.startswith("manifest."):
                continue
            shard = re.fullmatch(r"__(\d+)_\d+\.distcp", path.name)
            rng = re.fullmatch(r"rng\.rank(\d+)\.json", path.name)
            if shard:
                owner = int(shard.group(1))
            elif rng:
                owner = int(rng.group(1))
            else:
                owner = 0
            if owner == self.rank:
                names.append(path.name)
        return names

    def _commit(self, tmp: Path, final: Path) -> None:
        for path in tmp.iterdir():
            if path.is_file():
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(tmp)
        if final.exists():  # a stale copy of this step from before a rollback: keep it aside, never delete
            final.rename(_unused_name(final.with_name(final.name + ".old")))
        os.replace(tmp, final)
        fsync_dir(self.root)
        pointer = self.root / (LATEST_FILE + ".tmp")
        pointer.write_text(final.name + "\n", encoding="utf-8")
        with pointer.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(pointer, self.root / LATEST_FILE)
        fsync_dir(self.root)
        self._purge()

    def _purge(self) -> None:
        committed = self.committed()
        for old in committed[: max(0, len(committed) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.control_group)

    # -- finding and loading

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
        return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))

    def clean_uncommitted(self) -> None:
        """Remove `*.tmp` directories: writes that never committed (rank 0 only)."""
        if self.rank == 0 and self.root.is_dir():
            for path in self.root.glob("step_*.tmp"):
                shutil.rmtree(path, ignore_errors=True)

    def newest_valid(self, log: Callable[[str], None] = print) -> Path | None:
        """The newest checkpoint that validates; invalid ones are renamed `*.bad` (by rank 0) and skipped."""
        candidates = list(reversed(self.committed()))
        pointer = self.root / LATEST_FILE
        if pointer.is_file():
            named = self.root / pointer.read_text(encoding="utf-8").strip()
            if named in candidates:  # the pointer wins over directory order
                candidates.remove(named)
                candidates.insert(0, named)
        for candidate in candidates:
            try:
                verify_checkpoint(candidate)
                read_metadata(candidate)
                return candidate
            except ZayaError as exc:
                log(f"checkpoint {candidate.name} is invalid ({exc}); renaming it to .bad and trying an older one")
                if self.rank == 0:
                    candidate.rename(_unused_name(candidate.with_name(candidate.name + ".bad")))
        return None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or the newest valid checkpoint of a run or checkpoints directory."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    for root in (path / "checkpoints", path):
        if (root / LATEST_FILE).is_file() or any(root.glob("step_*")):
            found = CheckpointManager(root, keep=1 << 30).newest_valid(log=lambda _msg: None)
            if found is not None:
                return found
            raise ZayaError(f"{path}: no valid checkpoint")
    raise ZayaError(f"{path}: not a checkpoint, run or checkpoints directory")


def _unused_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}{n}")
        n += 1
    return candidate


# ---- small helpers ------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ZayaError(f"{path}: not valid JSON ({exc})") from None
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


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
