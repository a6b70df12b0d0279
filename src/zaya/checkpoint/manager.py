"""Training checkpoints and their commit protocol (system design section 6).

Commit protocol: everything is written into a fresh `step_N.tmp/`, which rank 0 makes and marks as zaya's
first (`files.STEP_MARKER`); each rank records its manifest; after a barrier on a separate gloo control group,
rank 0 fsyncs, renames the directory to `step_N/`, atomically replaces the `latest` pointer and only then
deletes the checkpoints beyond the newest `keep`. Loading picks the checkpoint `latest` names, else the newest
by directory order, whose manifests validate; a bad one is renamed `*.bad` by training, never deleted.

`checkpoint.dir` may point anywhere, a directory of the user's too: zaya removes or renames only step
directories it can prove it made (`files.zaya_made`: its marker, or its info file). Anything else named
`step_*` is left as it is; one that stands where a save must write is one error, not a deletion. A `latest`
that cannot be read (not UTF-8, too large, not a regular file, a name that is not a step of this directory) is
said in one line and the newest valid checkpoint by directory order is used instead.

The files of a checkpoint are listed in `zaya.checkpoint.files`; loading never executes code from one. What a
training checkpoint's tensors are, and how they reshard between world sizes, is `zaya.train.checkpointing`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager

from zaya import reading
from zaya.checkpoint.deadline import Deadline
from zaya.checkpoint.files import (
    INFO_FILE,
    LATEST_FILE,
    TRAIN_STATE_FILE,
    copy_input,
    is_checkpoint,
    plain_storage_error,
    real_directory,
    verify_checkpoint,
    write_json,
    write_manifest,
    write_step_marker,
    zaya_made,
)
from zaya.checkpoint.tensors import alone, dcp_save, rng_state
from zaya.device import pinned_host_memory
from zaya.errors import ZayaError, storage_error
from zaya.owned import fsync_dir
from zaya.reading import os_reason
from zaya.run_dir import CHECKPOINTS_DIR
from zaya.schema import shown

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
            except BaseException as exc:
                self._discard(tmp, exc)
                plain = plain_storage_error(exc, final)
                if plain is not None:
                    raise plain from exc
                raise
            finally:  # committed, or failed with an error of its own: either way not hung
                limit.cancel()

        try:
            refused = None
            if self.rank == 0:
                try:
                    self._fresh(tmp, final)
                except Exception as exc:  # said to every rank, not left for them to wait on at the barrier
                    refused = exc
            refused = self._from_rank_0(refused)
            if refused is not None:
                raise refused
            if async_save:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                                            process_group=self.control_group, async_stager=self._staging,
                                            no_dist=alone(self.control_group))
                self._pending = threading.Thread(target=self._run_pending, args=(finish, future), daemon=True)
                self._pending.start()
            else:
                dcp_save(tensors, tmp, self.control_group)
                finish(None)
        except BaseException as exc:  # before the writer took over: the deadline is this thread's to disarm
            limit.cancel()
            self._discard(tmp, exc)
            plain = plain_storage_error(exc, final)
            if plain is not None:
                raise plain from exc
            raise

    def _fresh(self, tmp: Path, final: Path) -> None:
        """Make `tmp` anew, marked as zaya's, after checking that nothing of anyone else's stands where the save
        writes: a `tmp` of zaya's (a killed save's) is removed, anything else there is an error."""
        advice = "move it away, or point checkpoint.dir at a directory of zaya's own"
        if os.path.lexists(final) and not zaya_made(final):
            raise ZayaError(f"{final}: exists and is not a checkpoint zaya wrote; refusing to replace it ({advice})")
        self._check_pointer(advice)
        taken = False  # an empty directory of that name is written into, not removed: nothing in it is lost
        if os.path.lexists(tmp):
            if zaya_made(tmp):
                shutil.rmtree(tmp)
            elif _empty_directory(tmp):
                taken = True
            else:
                raise ZayaError(f"{tmp}: exists and is not a checkpoint zaya was writing; refusing to delete it "
                                f"({advice})")
        if not taken:
            tmp.mkdir(parents=True)
        try:
            write_step_marker(tmp)
        except BaseException:
            if not taken:
                shutil.rmtree(tmp, ignore_errors=True)  # just made, holding at most the marker being written
            raise

    def _check_pointer(self, advice: str) -> None:
        """`latest` is replaced at the commit only if it is zaya's pointer: a regular file that names a step
        (`step_N`), or, where zaya's own checkpoints are, a regular file no larger than a pointer (a damaged pointer
        of this run's, rewritten). A link, a directory, a FIFO, a device, a larger file, or a small file beside no
        checkpoint of zaya's is someone else's."""
        latest = self.root / LATEST_FILE
        try:
            info = os.lstat(latest)
        except FileNotFoundError:
            return
        if stat.S_ISREG(info.st_mode) and info.st_size <= reading.CAPS["pointer"]:
            if _names_a_step(latest) or any(zaya_made(path) for path in self.committed()):
                return
            raise ZayaError(f"{latest}: not a pointer zaya wrote, and no checkpoint of zaya's is beside it; refusing "
                            f"to replace it ({advice})")
        kind = (f"larger than {reading.size_text(reading.CAPS['pointer'])}" if stat.S_ISREG(info.st_mode) else
                "a symbolic link" if stat.S_ISLNK(info.st_mode) else
                "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file")
        raise ZayaError(f"{latest}: {kind}, not a pointer zaya wrote; refusing to replace it ({advice})")

    def _discard(self, tmp: Path, exc: BaseException) -> None:
        """After a full disk (or another storage error) the partial checkpoint goes, giving back what it took; other
        failures leave it for `clean_uncommitted` (and for a look at what was written)."""
        if self.rank == 0 and storage_error(exc) is not None and zaya_made(tmp):
            shutil.rmtree(tmp, ignore_errors=True)

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
                copy_input(extra, tmp)

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
        if os.path.lexists(final):  # a stale copy of this step from before a rollback: keep it aside, never delete
            if not zaya_made(final):  # checked before the save, and again now that it is to be renamed
                raise ZayaError(f"{final}: exists and is not a checkpoint zaya wrote; refusing to replace it")
            final.rename(_unused_name(final.with_name(final.name + ".old")))
        os.replace(tmp, final)
        fsync_dir(self.root)
        self._point_to(final)
        fsync_dir(self.root)
        self._purge(final)

    def _point_to(self, final: Path) -> None:
        """Replace `latest` atomically by a pointer to `final`: a file of this process's own (a name with its pid and
        a token, made with O_EXCL | O_NOFOLLOW, never a name someone else may have put a link at), renamed over it."""
        latest = self.root / LATEST_FILE
        pointer = self.root / f".{LATEST_FILE}.zaya-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(pointer, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(final.name + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(pointer, latest)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                pointer.unlink()
            if isinstance(exc, OSError) and storage_error(exc) is None:
                raise ZayaError(f"{latest}: cannot replace ({os_reason(exc)})") from None
            if isinstance(exc, OSError):
                raise OSError(exc.errno, exc.strerror, str(latest)) from None
            raise

    def _purge(self, final: Path) -> None:
        """Remove the oldest of zaya's checkpoints beyond `keep`: never one it cannot prove it wrote, never `final`
        (just committed, which `latest` names)."""
        owned = [path for path in self.committed() if zaya_made(path)]
        for old in owned[: max(0, len(owned) - self.keep)]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.control_group)

    def _from_rank_0(self, value):
        """Rank 0's `value` on every rank (a barrier as well)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    # -- finding and loading

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
        return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))

    def clean_uncommitted(self, log: Callable[[str], None] | None = None) -> None:
        """Remove the `step_N.tmp` directories of zaya's saves that never committed (rank 0 only): those its marker
        proves are zaya's, and empty ones. Anything else of that name is left as it is, and said through `log`."""
        if self.rank != 0 or not self.root.is_dir():
            return
        for path in sorted(self.root.glob("step_*.tmp")):
            if not STEP_DIR.fullmatch(path.name.removesuffix(".tmp")):
                continue
            if zaya_made(path):
                shutil.rmtree(path, ignore_errors=True)
            elif log is not None and not _empty_directory(path):  # an empty one is taken over if a save needs it
                log(f"{path}: not a checkpoint zaya was writing; left as it is")

    def newest_valid(self, log: Callable[[str], None] = print, set_aside: bool = True,
                     check: Callable[[Path], None] | None = None) -> Path | None:
        """The newest checkpoint that validates (and passes `check`: what a resume reads besides, which raises
        `ZayaError`); invalid ones are skipped, and renamed `*.bad` (by rank 0) with `set_aside` (training does; a
        command that only reads changes nothing) when zaya made them. Each is said through `log`."""
        return self.choose(check, set_aside=set_aside, log=log).path

    def choose(self, check: Callable[[Path], None] | None = None, *, set_aside: bool = False,
               log: Callable[[str], None] | None = None) -> Choice:
        """The checkpoint to load: the one `latest` names, else (or if it is invalid) the newest by directory order
        that validates; see `newest_valid`."""
        choice = Choice()
        candidates = list(reversed(self.committed()))
        choice.newest = candidates[0] if candidates else None
        named, choice.pointer_note = self._pointer(candidates)
        if named is not None:  # the pointer wins over directory order
            candidates.remove(named)
            candidates.insert(0, named)
        if choice.pointer_note is not None and log is not None:
            log(f"{choice.pointer_note}; using the newest valid checkpoint by directory order")
        for candidate in candidates:
            try:
                verify_checkpoint(candidate)
                if check is not None:
                    check(candidate)
            except ZayaError as exc:
                choice.skipped.append((candidate, str(exc)))
                ours = set_aside and zaya_made(candidate)
                if log is not None:
                    action = ("renaming it to .bad and trying an older one" if ours else
                              "not a checkpoint zaya wrote, so left as it is; trying an older one" if set_aside else
                              "trying an older one")
                    log(f"checkpoint {candidate.name} is invalid ({exc}); {action}")
                if ours and self.rank == 0:
                    candidate.rename(_unused_name(candidate.with_name(candidate.name + ".bad")))
                continue
            choice.path, choice.named = candidate, candidate == named
            break
        return choice

    def _pointer(self, candidates: list[Path]) -> tuple[Path | None, str | None]:
        """The committed checkpoint `latest` names, or why it names none (None: there is no `latest`)."""
        pointer = self.root / LATEST_FILE
        if not os.path.lexists(pointer):
            return None, None
        try:
            text = reading.read_text(pointer, "pointer", "a checkpoint pointer", follow_links=False).strip()
        except ZayaError as exc:
            return None, str(exc)
        if not STEP_DIR.fullmatch(text):
            return None, f"{pointer}: names {shown(text)}, not a checkpoint directory beside it"
        if self.root / text not in candidates:
            return None, f"{pointer}: names {text}, which is not there"
        return self.root / text, None


@dataclass
class Choice:
    """What `CheckpointManager.choose` found: the checkpoint to load (None: no valid one), the newest by directory
    order, why `latest` was not followed, whether it named the one found, and each checkpoint passed over with why."""

    path: Path | None = None
    newest: Path | None = None
    pointer_note: str | None = None
    named: bool = False
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def note(self) -> str | None:
        """One line for a command that only reads, when what it loads is not simply the newest checkpoint."""
        parts = [self.pointer_note] if self.pointer_note is not None else []
        if self.path is not None and self.newest is not None and self.path != self.newest:
            if self.named:
                why = f"{LATEST_FILE} names it"
            else:
                reasons = dict(self.skipped)
                newer = sum(1 for path, _ in self.skipped if _step(path) > _step(self.path))
                why = f"{self.newest.name} is invalid ({reasons.get(self.newest, 'unreadable')})"
                if newer > 1:
                    why += f", and {newer - 1} more newer one{'s' if newer > 2 else ''}"
            parts.append(f"using checkpoint {self.path}, not the newest, {self.newest.name}: {why}")
        elif parts and self.path is not None:
            parts.append(f"using the newest valid checkpoint by directory order, {self.path}")
        return "warning: " + "; ".join(parts) if parts else None


def resolve_checkpoint(path: Path, log: Callable[[str], None] | None = None) -> Path:
    """A checkpoint directory itself, verified (a damaged one raises `ZayaError` naming the file), or the newest
    valid checkpoint of a run or checkpoints directory. Reads only: nothing is renamed or removed. When what it
    picks is not simply the newest (a newer one is invalid, `latest` names an older one or cannot be read), it says
    which and why in one line through `log` (default: stderr)."""
    path = Path(path)
    if is_checkpoint(path):
        verify_checkpoint(path)
        return path
    for root in (path / CHECKPOINTS_DIR, path):
        if os.path.lexists(root / LATEST_FILE) or any(root.glob("step_*")):
            choice = CheckpointManager(root, keep=1 << 30).choose()
            if choice.path is None:
                reasons = [why for _, why in choice.skipped] or [choice.pointer_note]
                raise ZayaError(f"{path}: no valid checkpoint{f' ({reasons[0]})' if reasons[0] else ''}")
            note = choice.note()
            if note is not None:
                (log or _to_stderr)(note)
            return choice.path
    raise ZayaError(f"{path}: not a checkpoint, run or checkpoints directory")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _step(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def _empty_directory(path: Path) -> bool:
    if not real_directory(path):
        return False
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _names_a_step(pointer: Path) -> bool:
    """Whether the file `pointer` holds what zaya writes there: a step directory's name and a newline."""
    try:
        text = reading.read_text(pointer, "pointer", follow_links=False)
    except ZayaError:
        return False
    return STEP_DIR.fullmatch(text.strip()) is not None


def _unused_name(path: Path) -> Path:
    candidate, n = path, 1
    while os.path.lexists(candidate):
        candidate = path.with_name(f"{path.name}{n}")
        n += 1
    return candidate
