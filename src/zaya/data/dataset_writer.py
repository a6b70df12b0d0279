"""Writing a dataset (the format is in `shards.py`).

A dataset is written into a staging directory of this process's (`zaya.owned.Staging`: a name with its pid and
a random token, and a marker file) that is renamed into place only when complete, and the manifest is its last
file: an interrupted build leaves nothing that opens as a dataset, and a killed one leaves a staging directory
that the next build into the same place removes by its marker. zaya replaces an existing output only with
--overwrite and only if it can prove the output is a dataset it wrote (`check_replaceable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zaya.data.content import Stream
from zaya.data.dataset_reader import Dataset, read_manifest
from zaya.data.shards import BUILD_FILE, DEFAULT_SHARD_TOKENS, DTYPES, FORMAT, MANIFEST_FILE, SPLITS, VERSION
from zaya.data.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.locking import DirectoryLock
from zaya.owned import Staging, remove_stale_staging
from zaya.reading import os_reason
from zaya.schema import shown


@contextlib.contextmanager
def staged_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """A fresh directory in which a dataset is written, renamed to `out` when the block finishes; if the block
    fails (or is interrupted: Ctrl-C, SIGTERM) it is removed, and nothing else is.

    The build holds `out`'s lock throughout (`zaya.locking`): one build writes `out` at a time, and, holding
    it, the build removes the staging directories that killed builds into `out` left beside it, those whose
    marker says zaya made them for `out` (`zaya.owned`), whatever else is there. An existing `out` is replaced
    only with `overwrite`, and only if it is empty or provably a dataset (`check_replaceable`)."""
    out = Path(out)
    check_out_name(out)
    with DirectoryLock(out, "zaya data build"):
        replace = check_replaceable(out, overwrite)
        remove_stale_staging(out, locked=True)
        with Staging(out, "zaya data build") as staging:
            try:
                staging.path.mkdir()
            except OSError as exc:
                raise ZayaError(f"{out}: cannot create ({os_reason(exc)})") from None
            yield staging.path
            if replace:
                check_replaceable(out, overwrite)  # again, just before it goes: it may have changed meanwhile
            staging.commit(replace=replace)


def check_replaceable(out: Path, overwrite: bool) -> bool:
    """Whether `out` exists and may be replaced; a `ZayaError` if it exists and may not: without `overwrite`,
    or when it is anything but an empty directory or a dataset. A dataset is a directory whose manifest reads
    under its schema (format, version, every field of its type, checksummed files) and holds the files the
    manifest lists and nothing but those, the manifest and build.json: a directory that merely holds a file
    called manifest.json is not one, and neither is a dataset beside which someone keeps other files."""
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ZayaError(f"{out}: cannot use as the output ({os_reason(exc)})") from None
    if not overwrite:
        raise ZayaError(f"{out}: already exists; pass --overwrite to replace it")
    if stat.S_ISLNK(info.st_mode):
        raise ZayaError(f"{out}: exists and is a symbolic link; refusing to replace it")
    if not stat.S_ISDIR(info.st_mode):
        raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it (not a directory)")
    try:
        entries = set(os.listdir(out))
    except OSError as exc:
        raise ZayaError(f"{out}: cannot read ({os_reason(exc)})") from None
    if not entries:
        return True
    if MANIFEST_FILE not in entries:
        raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it (no {MANIFEST_FILE})")
    try:
        manifest, splits = read_manifest(out)
    except ZayaError as exc:
        reason = str(exc).removeprefix(f"{out / MANIFEST_FILE}: ")[:200]
        raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it ({MANIFEST_FILE}: {reason})"
                        ) from None
    listed = {entry.file for entry in Dataset(out, manifest, splits).files()}
    for name in sorted(listed):
        if not stat.S_ISREG(_lstat_mode(out / name)):
            raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it ({name}, which its "
                            "manifest lists, is not there as a file)")
    extra = sorted(entries - listed - {MANIFEST_FILE, BUILD_FILE})
    if extra:
        raise ZayaError(f"{out}: holds {shown(extra[0])}, which is not part of its dataset; refusing to replace it "
                        "(move it away first)")
    return True


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


_NAME_MAX = 255  # bytes in one name, where the file system does not say
_PATH_MAX = 4096
# the longest names a build makes: in the output (a shard's mask file), and beside it (the lock, a staging
# directory: `owned.Staging` keeps 96 characters of the name and adds ".zaya-PID-TOKEN/new")
_LONGEST_FILE = len("train.00000000.mask.bin")
_LOCK_SUFFIX = len("..lock")
_STAGING = 1 + 96 + len(".zaya-4194304-0123456789ab/new/")


def check_out_name(out: Path) -> None:
    """Refuse, before anything is made, an output whose name or path the file system cannot hold (with the lock
    file `.NAME.lock` beside it and the files inside it): one line naming `--out`."""
    if out.name in ("", ".", ".."):
        raise ZayaError(f"--out {shown(str(out))}: must name the dataset directory to write, not '.' or '..'")
    name_max, path_max = _limits(out)
    name = len(os.fsencode(out.name))
    if name + _LOCK_SUFFIX > name_max:
        raise ZayaError(f"{out}: name too long ({name} bytes; with its lock file .NAME.lock beside it, at most "
                        f"{name_max - _LOCK_SUFFIX} bytes here)")
    absolute = os.path.abspath(out)
    for part in Path(absolute).parts:
        if len(os.fsencode(part)) > name_max:
            raise ZayaError(f"{out}: name too long ({shown(part, 30)} has {len(os.fsencode(part))} bytes; at most "
                            f"{name_max} here)")
    longest = max(len(os.fsencode(absolute)) + 1 + _LONGEST_FILE,
                  len(os.fsencode(os.path.dirname(absolute))) + _STAGING + _LONGEST_FILE)
    if longest >= path_max:
        raise ZayaError(f"{out}: path too long (its files' paths would have {longest} bytes; at most "
                        f"{path_max - 1} here)")


def _limits(out: Path) -> tuple[int, int]:
    """The file system's longest name and path, asked of the nearest directory that exists."""
    directory = Path(os.path.abspath(out)).parent
    while True:
        try:
            return os.pathconf(directory, "PC_NAME_MAX"), os.pathconf(directory, "PC_PATH_MAX")
        except (OSError, ValueError):
            if directory.parent == directory:
                return _NAME_MAX, _PATH_MAX
            directory = directory.parent


class _SplitWriter:
    """Appends one split's documents to its shard files and document index, hashing as it writes; with
    `masked`, their loss mask to a mask file beside each shard."""

    def __init__(self, directory: Path, name: str, dtype: str, shard_tokens: int, masked: bool = False) -> None:
        self.directory, self.name, self.dtype, self.shard_tokens = directory, name, DTYPES[dtype], shard_tokens
        self.masked = masked
        self.num_tokens = 0
        self.num_documents = 0
        self.loss_tokens = 0
        self.max_token_id: int | None = None
        self.shards: list[dict] = []
        self._shard: tuple[Any, Any, str] | None = None  # open file, running hash, name
        self._mask: tuple[Any, Any, str] | None = None  # the same for the shard's mask
        self._shard_tokens = 0
        self._docs_name = f"{name}.docs.bin"
        self._docs = open(directory / self._docs_name, "wb")  # noqa: SIM115 - closed in close()
        self._docs_hash = hashlib.sha256()
        # what the split holds, as hashes a merge of parts can join (`zaya.data.content`)
        self._content = {"tokens": Stream(), "documents": Stream(), **({"mask": Stream()} if masked else {})}

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        if len(doc_lengths) == 0:
            return
        if mask is not None:
            mask = mask.astype(np.uint8, copy=False)
            self.loss_tokens += int(np.count_nonzero(mask))
        self._content["tokens"] = self._content["tokens"].extend(tokens)
        self._content["documents"] = self._content["documents"].extend(doc_lengths)
        if mask is not None:
            self._content["mask"] = self._content["mask"].extend(mask)
        ends = (self.num_tokens + np.cumsum(doc_lengths, dtype=np.int64)).astype("<i8")
        self._docs.write(ends.tobytes())
        self._docs_hash.update(ends.tobytes())
        self.num_documents += len(doc_lengths)
        top = int(tokens.max())
        self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)
        data = tokens.astype(self.dtype, copy=False)
        while len(data):
            if self._shard is None:
                self._open_shard()
            room = self.shard_tokens - self._shard_tokens
            part, data = data[:room], data[room:]
            handle, digest, _ = self._shard
            handle.write(part.tobytes())
            digest.update(part.tobytes())
            if mask is not None:
                flags, mask = mask[:room], mask[room:]
                handle, digest, _ = self._mask
                handle.write(flags.tobytes())
                digest.update(flags.tobytes())
            self._shard_tokens += len(part)
            self.num_tokens += len(part)
            if self._shard_tokens == self.shard_tokens:
                self._close_shard()

    def _open_shard(self) -> None:
        name = f"{self.name}.{len(self.shards):05d}.bin"
        self._shard = (open(self.directory / name, "wb"), hashlib.sha256(), name)  # noqa: SIM115
        if self.masked:
            mask = name.removesuffix(".bin") + ".mask.bin"
            self._mask = (open(self.directory / mask, "wb"), hashlib.sha256(), mask)  # noqa: SIM115
        self._shard_tokens = 0

    def _close_shard(self) -> None:
        handle, digest, name = self._shard
        handle.close()
        entry = {"file": name, "bytes": self._shard_tokens * self.dtype.itemsize, "sha256": digest.hexdigest(),
                 "num_tokens": self._shard_tokens}
        if self._mask is not None:
            handle, digest, mask = self._mask
            handle.close()
            entry["mask"] = {"file": mask, "bytes": self._shard_tokens, "sha256": digest.hexdigest()}
            self._mask = None
        self.shards.append(entry)
        self._shard = None

    def close(self) -> dict:
        if self._shard is not None:
            self._close_shard()
        self._docs.close()
        entry = {
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "shards": self.shards,
            "documents": {"file": self._docs_name, "bytes": self.num_documents * 8,
                          "sha256": self._docs_hash.hexdigest()},
            "content": {key: stream.text() for key, stream in self._content.items()},
        }
        if self.masked:
            entry["loss_tokens"] = self.loss_tokens
        return entry

    def abort(self) -> None:
        self._docs.close()
        for file in (self._shard, self._mask):
            if file is not None:
                file[0].close()


class DatasetWriter:
    """Writes a dataset into an (empty, staging) directory: documents split by split, then the manifest. With
    `loss_mask`, every write brings the documents' loss mask (one 0/1 byte per token)."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 loss_mask: bool = False) -> None:
        if shard_tokens < 1:
            raise ZayaError(f"shard size must be at least 1 token, got {shard_tokens}")
        self.directory = Path(directory)
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.loss_mask = loss_mask
        self._splits = {name: _SplitWriter(self.directory, name, dtype, shard_tokens, loss_mask) for name in SPLITS}

    def write(self, split: str, tokens: np.ndarray, doc_lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents (their tokens back to back, and each one's length) to a split."""
        if int(np.sum(doc_lengths)) != len(tokens):
            raise ValueError("document lengths do not add up to the number of tokens")
        if (mask is not None) != self.loss_mask or (mask is not None and len(mask) != len(tokens)):
            raise ValueError("a masked dataset takes one mask byte per token with every write, another none")
        self._splits[split].write(tokens, doc_lengths, mask)

    def finish(self, tokenizer_json: bytes, tokenizer: dict, corpus: dict, chat_template: dict | None = None) -> dict:
        """Write the tokenizer (and its `chat_template`: {"template": text, "end_of_turn": marker}) and, last,
        the manifest; returns the manifest."""
        (self.directory / TOKENIZER_FILE).write_bytes(tokenizer_json)
        tokenizer = {"file": TOKENIZER_FILE, "bytes": len(tokenizer_json), **tokenizer}
        if chat_template is not None:
            text = chat_template["template"].encode("utf-8")
            (self.directory / CHAT_TEMPLATE_FILE).write_bytes(text)
            tokenizer["chat_template"] = {"file": CHAT_TEMPLATE_FILE, "bytes": len(text),
                                          "sha256": hashlib.sha256(text).hexdigest(),
                                          "end_of_turn": chat_template["end_of_turn"]}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "tokenizer": tokenizer,
            "splits": {name: writer.close() for name, writer in self._splits.items()},
            "corpus": corpus,
        }
        if self.loss_mask:
            manifest["loss_mask"] = True  # absent from text datasets, whose manifests stay as they were
        (self.directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return manifest

    def abort(self) -> None:
        """Close open files after a failure (the staging directory is removed by its owner)."""
        for writer in self._splits.values():
            writer.abort()
