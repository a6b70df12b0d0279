"""Training checkpoints and their commit protocol (system design section 6).

Commit protocol: everything is written into a fresh `step_N.tmp/`; each rank records its manifest; after a
barrier on a separate gloo control group, rank 0 fsyncs, renames the directory to `step_N/`, atomically
replaces the `latest` pointer and only then deletes the checkpoints beyond the newest `keep`. Loading picks
the newest checkpoint whose manifests validate; a bad one is renamed `*.bad`, never deleted.

The files of a checkpoint are listed in `zaya.checkpoint.files`; loading never executes code from one. What a
training checkpoint's tensors are, and how they reshard between world sizes, is `zaya.train.checkpointing`.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager

from zaya.checkpoint.deadline import Deadline
from zaya.checkpoint.files import (
    INFO_FILE,
    LATEST_FILE,
    TRAIN_STATE_FILE,
    fsync_dir,
    is_checkpoint,
    read_metadata,
    verify_checkpoint,
    write_json,
    write_manifest,
)
from zaya.checkpoint.tensors import dcp_save, rng_state
from zaya.device import pinned_host_memory
from zaya.errors import ZayaError
from zaya.run_dir import CHECKPOINTS_DIR

STEP_DIR = re.compile(r"step_(\d+)")


# ---- training checkpoints -----------------------------------------------------------------------------


class HostCopies(AsyncStager):
    """The staging of async saves: host copies of the checkpoint's tensors, made once and refilled at every
    save with one copy per tensor, after which training may change the originals. (DCP's default stager
    makes new copies at every save, deep-copying each DTensor twice: measured, 4.2 s to stage the 888 MB
    `small` training state against 0.2-0.4 s to refill these; its cached variant pins memory, which a CPU
    build of torch cannot.) The copies are made again if the tensors' shapes or dtypes change."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._copies: dict | None = None
        self._signature: tuple | None = None

    def stage(self, state_dict: dict) -> dict:
        signature = _signature(state_dict)
        if signature != self._signature:
            self._copies = _create_cpu_state_dict(state_dict, pin_memory=pinned_host_memory())
            self._signature = signature
        return _copy_state_dict(state_dict, self._copies)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        self._copies = self._signature = None


def _signature(state: dict, prefix: str = "") -> tuple:
    items = []
    for key, value in state.items():
        if isinstance(value, dict):
            items += _signature(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            items.append((prefix + key, tuple(value.shape), value.dtype, type(value).__name__))
        else:
            items.append((prefix + key, type(value).__name__))
    return tuple(items)



class CheckpointManager:
    """Saves and finds training checkpoints under `root` with the commit protocol of the module docstring.

    In a multi-process job every rank calls `save` at the same step; the barrier before the commit runs on
    `control_group`, a gloo group of its own, so that it never queues behind training collectives.
    """

    def __init__(self, root: Path, keep: int, rank: int = 0, world_size: int = 1, control_group=None,
                 timeout_s: float = 0.0):
        self.root = Path(root)
        self.timeout_s = timeout_s  # a save that takes longer ends the process (`zaya.checkpoint.deadline`)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.control_group = control_group
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._staging = HostCopies()
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
        limit = Deadline(self.timeout_s, f"checkpoint step {step}'s save").start()  # disarmed once committed
        final = self.root / f"step_{step:08d}"
        tmp = final.with_name(final.name + ".tmp")

        def finish(future: Future | None) -> None:
            try:
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
            finally:  # committed, or failed with an error of its own: either way not hung
                limit.cancel()

        try:
            if self.rank == 0:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            self._barrier()
            if async_save:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                                            process_group=self.control_group, async_stager=self._staging)
                self._pending = threading.Thread(target=self._run_pending, args=(finish, future), daemon=True)
                self._pending.start()
            else:
                dcp_save(tensors, tmp, self.control_group)
                finish(None)
        except BaseException:  # before the writer took over: the deadline is this thread's to disarm
            limit.cancel()
            raise

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
            write_json(tmp / INFO_FILE, {**info, "world_size": self.world_size})
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

    def newest_valid(self, log: Callable[[str], None] = print, set_aside: bool = True,
                     check: Callable[[Path], None] | None = None) -> Path | None:
        """The newest checkpoint that validates (and passes `check`: what a resume reads besides, which raises
        `ZayaError`); invalid ones are skipped, and renamed `*.bad` (by rank 0) with `set_aside` (training does; a
        command that only reads changes nothing)."""
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
                if check is not None:
                    check(candidate)
                return candidate
            except ZayaError as exc:
                if not set_aside:
                    log(f"checkpoint {candidate.name} is invalid ({exc}); trying an older one")
                    continue
                log(f"checkpoint {candidate.name} is invalid ({exc}); renaming it to .bad and trying an older one")
                if self.rank == 0:
                    candidate.rename(_unused_name(candidate.with_name(candidate.name + ".bad")))
        return None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, verified (a damaged one raises `ZayaError` naming the file), or the newest
    valid checkpoint of a run or checkpoints directory. Reads only: nothing is renamed."""
    path = Path(path)
    if is_checkpoint(path):
        verify_checkpoint(path)
        read_metadata(path)
        return path
    for root in (path / CHECKPOINTS_DIR, path):
        if (root / LATEST_FILE).is_file() or any(root.glob("step_*")):
            found = CheckpointManager(root, keep=1 << 30).newest_valid(log=lambda _msg: None, set_aside=False)
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
