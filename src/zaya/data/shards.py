"""The on-disk dataset: flat token files grouped into super-shards, a document index, and a manifest.

    dataset/
        manifest.json         files with sizes and SHA-256, token and document counts, the tokenizer's hash
        tokenizer.json        the tokenizer the tokens were made with
        train.00000.bin ...   the train split's tokens, flat little-endian uint16 (vocab <= 65536) or uint32
        train.docs.bin        little-endian int64: where each document ends in the split's token stream
        val.00000.bin ...     the held-out validation split, likewise
        val.docs.bin
        build.json            how it was built (inputs, options, skipped records); not part of the fingerprint

A split is one token stream stored as super-shards of `shard_tokens` tokens each (the last one shorter), so
that large sequential reads stay inside one big file; a read that crosses a shard boundary is served from
both files. Every document ends with the tokenizer's end-of-document token.

The fingerprint is the SHA-256 of the manifest's canonical JSON. The manifest holds no paths, times or
build options, so two builds of the same inputs have the same fingerprint wherever they are written, and a
change to any token changes a checksum and with it the fingerprint.

A dataset is written into a staging directory that is renamed into place only when complete, and the
manifest is its last file: an interrupted build leaves nothing that opens as a dataset.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from zaya.errors import ZayaError

FORMAT = "zaya-dataset"
VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
BUILD_FILE = "build.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per super-shard
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_CAN_ADVISE = hasattr(os, "posix_fadvise")
_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> str:
    """The narrowest token type that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def fingerprint_of(manifest: dict) -> str:
    """The dataset fingerprint: SHA-256 of the manifest's canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def sha256_file(path: Path, progress: tqdm | None = None) -> str:
    """SHA-256 of a file, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


# ---- writing ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def staged_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """A fresh directory beside `out` that becomes `out` when the block finishes, and vanishes if it fails.

    An existing `out` is replaced only with `overwrite`, and only if it is a dataset or empty, so a mistyped
    path cannot delete unrelated files."""
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise ZayaError(f"{out}: already exists; pass --overwrite to replace it")
        if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_FILE).is_file()):
            raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # mkdir, unlike mkdtemp, honours the umask: the renamed directory gets ordinary permissions
        staging = out.parent / f".{out.name}.partial-{secrets.token_hex(6)}"
        staging.mkdir()
    except OSError as exc:
        raise ZayaError(f"{out}: cannot create ({exc.strerror})") from None
    try:
        yield staging
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(retired / "dataset")
            staging.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class _SplitWriter:
    """Appends one split's documents to its shard files and document index, hashing as it writes."""

    def __init__(self, directory: Path, name: str, dtype: str, shard_tokens: int) -> None:
        self.directory, self.name, self.dtype, self.shard_tokens = directory, name, _DTYPES[dtype], shard_tokens
        self.num_tokens = 0
        self.num_documents = 0
        self.max_token_id: int | None = None
        self.shards: list[dict] = []
        self._shard: tuple[Any, Any, str] | None = None  # open file, running hash, name
        self._shard_tokens = 0
        self._docs_name = f"{name}.docs.bin"
        self._docs = open(directory / self._docs_name, "wb")  # noqa: SIM115 - closed in close()
        self._docs_hash = hashlib.sha256()

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        if len(doc_lengths) == 0:
            return
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
            self._shard_tokens += len(part)
            self.num_tokens += len(part)
            if self._shard_tokens == self.shard_tokens:
                self._close_shard()

    def _open_shard(self) -> None:
        name = f"{self.name}.{len(self.shards):05d}.bin"
        self._shard = (open(self.directory / name, "wb"), hashlib.sha256(), name)  # noqa: SIM115
        self._shard_tokens = 0

    def _close_shard(self) -> None:
        handle, digest, name = self._shard
        handle.close()
        self.shards.append({"file": name, "bytes": self._shard_tokens * self.dtype.itemsize,
                            "sha256": digest.hexdigest(), "num_tokens": self._shard_tokens})
        self._shard = None

    def close(self) -> dict:
        if self._shard is not None:
            self._close_shard()
        self._docs.close()
        return {
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "shards": self.shards,
            "documents": {"file": self._docs_name, "bytes": self.num_documents * 8,
                          "sha256": self._docs_hash.hexdigest()},
        }

    def abort(self) -> None:
        self._docs.close()
        if self._shard is not None:
            self._shard[0].close()


class DatasetWriter:
    """Writes a dataset into an (empty, staging) directory: documents split by split, then the manifest."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        if shard_tokens < 1:
            raise ZayaError(f"shard size must be at least 1 token, got {shard_tokens}")
        self.directory = Path(directory)
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self._splits = {name: _SplitWriter(self.directory, name, dtype, shard_tokens) for name in SPLITS}

    def write(self, split: str, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append documents (their tokens back to back, and each one's length) to a split."""
        if int(np.sum(doc_lengths)) != len(tokens):
            raise ValueError("document lengths do not add up to the number of tokens")
        self._splits[split].write(tokens, doc_lengths)

    def finish(self, tokenizer_json: bytes, tokenizer: dict, corpus: dict) -> dict:
        """Write the tokenizer and, last, the manifest; returns the manifest."""
        (self.directory / TOKENIZER_FILE).write_bytes(tokenizer_json)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "tokenizer": {"file": TOKENIZER_FILE, "bytes": len(tokenizer_json), **tokenizer},
            "splits": {name: writer.close() for name, writer in self._splits.items()},
            "corpus": corpus,
        }
        (self.directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return manifest

    def abort(self) -> None:
        """Close open files after a failure (the staging directory is removed by its owner)."""
        for writer in self._splits.values():
            writer.abort()


# ---- reading ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """A file listed in the manifest."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitEntry:
    """One split as the manifest describes it."""

    name: str
    num_tokens: int
    num_documents: int
    max_token_id: int | None
    shards: tuple[FileEntry, ...]
    shard_tokens: tuple[int, ...]
    documents: FileEntry


class SplitTokens:
    """Random access to one split's token stream through read-only memory maps of its shards."""

    def __init__(self, directory: Path, entry: SplitEntry, dtype: np.dtype) -> None:
        self.name = entry.name
        self.num_tokens = entry.num_tokens
        self.num_documents = entry.num_documents
        self._docs_path = directory / entry.documents.file
        self.dtype = dtype
        # plain ndarrays over the mappings: np.memmap's Python-level indexing costs microseconds per call
        self._maps = [np.asarray(np.memmap(directory / shard.file, dtype=dtype, mode="r"))
                      for shard in entry.shards]
        # descriptors for read-ahead advice; posix_fadvise, unlike mmap.madvise, releases the GIL
        self._fds = [os.open(directory / shard.file, os.O_RDONLY) for shard in entry.shards] if _CAN_ADVISE else []
        for fd in self._fds:
            weakref.finalize(self, os.close, fd)
        self._starts = [0, *np.cumsum(entry.shard_tokens).tolist()]
        self._windows: dict[int, list[tuple[int, np.ndarray]]] = {}

    def advise(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Ask the operating system to start reading token ranges [start, stop) into memory, and return at
        once. A no-op where posix_fadvise is unavailable."""
        if not _CAN_ADVISE:
            return
        itemsize = self.dtype.itemsize
        for start, stop in ranges:
            shard = bisect.bisect_right(self._starts, start) - 1
            while start < stop:
                end = min(stop, self._starts[shard + 1])
                offset = (start - self._starts[shard]) * itemsize
                length = (end - start) * itemsize
                os.posix_fadvise(self._fds[shard], offset, length, os.POSIX_FADV_WILLNEED)
                start, shard = end, shard + 1

    def gather(self, samples: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows of seq_len + 1 tokens as an array [len(samples), seq_len + 1] of the stored dtype; window i
        is tokens [i * seq_len, i * seq_len + seq_len + 1).

        Windows are gathered from strided views of the shards in one vectorised copy per shard; the few that
        cross from one shard file into the next are read piecewise."""
        samples = np.asarray(samples, dtype=np.int64)
        views = self._window_views(seq_len)
        if len(views) == 1 and len(samples) and samples.min() >= 0:
            first, windows = views[0]
            if samples.max() - first < len(windows):
                return windows[samples - first]
        out = np.empty((len(samples), seq_len + 1), dtype=self.dtype)
        firsts = np.array([first for first, _ in views], dtype=np.int64)
        shard_of = np.searchsorted(firsts, samples, side="right") - 1
        handled = np.zeros(len(samples), dtype=bool)
        for shard in np.unique(shard_of[shard_of >= 0]).tolist():
            first, windows = views[shard]
            rows = np.flatnonzero((shard_of == shard) & (samples - first < len(windows)))
            out[rows] = windows[samples[rows] - first]
            handled[rows] = True
        for row in np.flatnonzero(~handled).tolist():
            self.read_into(out[row], int(samples[row]) * seq_len)
        return out

    def _window_views(self, seq_len: int) -> list[tuple[int, np.ndarray]]:
        """Per shard: the index of the first window lying wholly inside it, and a [count, seq_len + 1] view of
        those windows (neighbouring rows overlap by one token)."""
        if seq_len not in self._windows:
            views = []
            for tokens, start in zip(self._maps, self._starts, strict=False):
                first = -(-start // seq_len)
                offset = first * seq_len - start
                count = max(0, (len(tokens) - offset - 1) // seq_len)
                if count == 0:
                    views.append((first, np.empty((0, seq_len + 1), dtype=tokens.dtype)))
                    continue
                strided = np.lib.stride_tricks.sliding_window_view(tokens[offset:], seq_len + 1)[::seq_len]
                views.append((first, strided[:count]))
            self._windows[seq_len] = views
        return self._windows[seq_len]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, as a new array of the stored dtype."""
        out = np.empty(stop - start, dtype=self.dtype)
        self.read_into(out, start)
        return out

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill `out` (any integer dtype) with the tokens from `start` on."""
        stop = start + len(out)
        if start < 0 or stop > self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) are outside the {self.name} split of {self.num_tokens}")
        shard = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < len(out):
            offset = start + done - self._starts[shard]
            take = min(len(out) - done, self._starts[shard + 1] - self._starts[shard] - offset)
            out[done:done + take] = self._maps[shard][offset:offset + take]
            done += take
            shard += 1

    def document_ends(self) -> np.ndarray:
        """Where each document ends in the stream (document i spans ends[i-1]..ends[i])."""
        if self.num_documents == 0:
            return np.zeros(0, dtype=np.int64)
        return np.memmap(self._docs_path, dtype="<i8", mode="r")


class Dataset:
    """An opened dataset directory. Use `open_dataset` to make one."""

    def __init__(self, path: Path, manifest: dict, splits: dict[str, SplitEntry]) -> None:
        self.path = path
        self.manifest = manifest
        self.fingerprint = fingerprint_of(manifest)
        self.dtype = _DTYPES[manifest["dtype"]]
        self.entries = splits
        tokenizer = manifest["tokenizer"]
        self.vocab_size: int = tokenizer["vocab_size"]
        self.eos_id: int = tokenizer["eos_id"]
        self.special_ids: dict[str, int] = tokenizer["special_ids"]
        self.tokenizer_sha256: str = tokenizer["sha256"]
        self.tokenizer_path = path / tokenizer["file"]
        self._opened: dict[str, SplitTokens] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens in all splits together."""
        return sum(entry.num_tokens for entry in self.entries.values())

    @property
    def num_documents(self) -> int:
        """Documents in all splits together."""
        return sum(entry.num_documents for entry in self.entries.values())

    @property
    def max_token_id(self) -> int:
        """The largest token id in the data (-1 for a dataset without tokens)."""
        ids = [entry.max_token_id for entry in self.entries.values() if entry.max_token_id is not None]
        return max(ids, default=-1)

    def split(self, name: str) -> SplitTokens:
        """The token stream of a split ("train" or "val")."""
        if name not in self.entries:
            raise ZayaError(f"{self.path}: no split '{name}' (splits: {', '.join(self.entries)})")
        if name not in self._opened:
            self._opened[name] = SplitTokens(self.path, self.entries[name], self.dtype)
        return self._opened[name]

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse a model whose vocabulary cannot embed every token id of this dataset."""
        if self.max_token_id >= model_vocab_size:
            raise ZayaError(
                f"{self.path}: token id {self.max_token_id} does not fit the model's vocabulary of "
                f"{model_vocab_size} (the dataset's tokenizer has {self.vocab_size} entries); use a model with "
                f"vocab_size >= {self.vocab_size} or rebuild the data with --vocab-size {model_vocab_size}"
            )

    def files(self) -> list[FileEntry]:
        """Every file the manifest lists."""
        tokenizer = self.manifest["tokenizer"]
        entries = [FileEntry(tokenizer["file"], tokenizer["bytes"], tokenizer["sha256"])]
        for entry in self.entries.values():
            entries.extend(entry.shards)
            entries.append(entry.documents)
        return entries

    def verify(self, progress: bool = False) -> int:
        """Recompute every checksum; raises a `ZayaError` naming the first file that does not match.

        Returns the number of files checked."""
        entries = self.files()
        with tqdm(total=sum(e.bytes for e in entries), unit="B", unit_scale=True, desc="verifying",
                  disable=not progress) as bar:
            for entry in entries:
                actual = sha256_file(self.path / entry.file, bar)
                if actual != entry.sha256:
                    raise ZayaError(f"{self.path / entry.file}: checksum mismatch (the manifest says "
                                    f"{entry.sha256[:16]}..., the file has {actual[:16]}...)")
        return len(entries)

    def summary(self) -> dict:
        """The manifest's key facts, for `zaya data inspect`."""
        return {
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "dtype": self.manifest["dtype"],
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "tokenizer": self.manifest["tokenizer"],
            "splits": {
                name: {"num_tokens": e.num_tokens, "num_documents": e.num_documents, "shards": len(e.shards),
                       "bytes": sum(s.bytes for s in e.shards)}
                for name, e in self.entries.items()
            },
            "corpus": self.manifest["corpus"],
        }


def open_dataset(path: str | Path) -> Dataset:
    """Open a dataset directory, checking its manifest and that every file is there with the right size.

    Checksums are not recomputed here (that reads everything); `Dataset.verify` does it."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise ZayaError(f"{path}: no such dataset directory")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{manifest_path}: file not found; is '{path}' a dataset built by 'zaya data build'?") from None
    except (OSError, ValueError) as exc:
        raise ZayaError(f"{manifest_path}: not a readable manifest ({exc})") from None
    fields = _Fields(manifest_path)
    if fields.get(manifest, "format", str) != FORMAT:
        raise ZayaError(f"{manifest_path}: field 'format' is {manifest['format']!r}, expected {FORMAT!r}")
    if fields.get(manifest, "version", int) != VERSION:
        raise ZayaError(f"{manifest_path}: field 'version' is {manifest['version']}, this zaya reads {VERSION}")
    if fields.get(manifest, "dtype", str) not in _DTYPES:
        raise ZayaError(f"{manifest_path}: field 'dtype' is {manifest['dtype']!r}, expected uint16 or uint32")
    fields.get(manifest, "corpus", dict)
    tokenizer = fields.get(manifest, "tokenizer", dict)
    _file_entry(fields, tokenizer, "tokenizer.")
    for key, kind in (("vocab_size", int), ("eos_id", int), ("special_ids", dict)):
        fields.get(tokenizer, key, kind, "tokenizer.")
    itemsize = _DTYPES[manifest["dtype"]].itemsize
    splits_field = fields.get(manifest, "splits", dict)
    splits = {name: _split_entry(fields, splits_field, name, itemsize) for name in SPLITS}
    dataset = Dataset(path, manifest, splits)
    for entry in dataset.files():
        _check_size(path / entry.file, entry.bytes)
    return dataset


class _Fields:
    """Typed access to manifest fields, with errors that name the file and the field."""

    def __init__(self, source: Path) -> None:
        self.source = source

    def get(self, obj: dict, key: str, kind: type, prefix: str = "") -> Any:
        if key not in obj:
            raise ZayaError(f"{self.source}: missing field '{prefix}{key}'")
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ZayaError(f"{self.source}: field '{prefix}{key}' must be {kind.__name__}, got {value!r}")
        if kind is int and value < 0:
            raise ZayaError(f"{self.source}: field '{prefix}{key}' must not be negative, got {value}")
        return value


def _split_entry(fields: _Fields, splits: dict, name: str, itemsize: int) -> SplitEntry:
    prefix = f"splits.{name}."
    split = fields.get(splits, name, dict, "splits.")
    shards, counts = [], []
    for i, shard in enumerate(fields.get(split, "shards", list, prefix)):
        where = f"{prefix}shards[{i}]."
        if not isinstance(shard, dict):
            raise ZayaError(f"{fields.source}: field '{where[:-1]}' must be an object")
        entry = _file_entry(fields, shard, where)
        count = fields.get(shard, "num_tokens", int, where)
        if count * itemsize != entry.bytes:
            raise ZayaError(f"{fields.source}: field '{where}bytes' is {entry.bytes}, but {count} tokens take "
                            f"{count * itemsize}")
        shards.append(entry)
        counts.append(count)
    num_tokens = fields.get(split, "num_tokens", int, prefix)
    if sum(counts) != num_tokens:
        raise ZayaError(f"{fields.source}: field '{prefix}num_tokens' is {num_tokens}, but the shards hold "
                        f"{sum(counts)}")
    max_token_id = split.get("max_token_id")
    if max_token_id is not None and (not isinstance(max_token_id, int) or isinstance(max_token_id, bool)):
        raise ZayaError(f"{fields.source}: field '{prefix}max_token_id' must be int or null, got {max_token_id!r}")
    return SplitEntry(
        name=name,
        num_tokens=num_tokens,
        num_documents=fields.get(split, "num_documents", int, prefix),
        max_token_id=max_token_id,
        shards=tuple(shards),
        shard_tokens=tuple(counts),
        documents=_file_entry(fields, fields.get(split, "documents", dict, prefix), f"{prefix}documents."),
    )


def _file_entry(fields: _Fields, obj: dict, prefix: str) -> FileEntry:
    name = fields.get(obj, "file", str, prefix)
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise ZayaError(f"{fields.source}: field '{prefix}file' must be a plain file name, got {name!r}")
    return FileEntry(name, fields.get(obj, "bytes", int, prefix), fields.get(obj, "sha256", str, prefix))


def _check_size(path: Path, expected: int) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found (listed in the manifest)") from None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None
    if actual != expected:
        raise ZayaError(f"{path}: {actual} bytes, but the manifest says {expected} (truncated or replaced?)")
