"""Writing a dataset (the format is in `shards.py`).

A dataset is written into a staging directory that is renamed into place only when complete, and the
manifest is its last file: an interrupted build leaves nothing that opens as a dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zaya.data.shards import DEFAULT_SHARD_TOKENS, DTYPES, FORMAT, MANIFEST_FILE, SPLITS, VERSION
from zaya.data.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.locking import DirectoryLock


@contextlib.contextmanager
def staged_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """A fresh directory beside `out` that becomes `out` when the block finishes, and vanishes if it fails.

    An existing `out` is replaced only with `overwrite`, and only if it is a dataset or empty, so a mistyped
    path cannot delete unrelated files. One build writes `out` at a time (`zaya.locking`); holding the lock, the
    build removes what killed builds into the same place left beside it."""
    out = Path(out)
    with DirectoryLock(out, "zaya data build"):
        if out.exists():
            if not overwrite:
                raise ZayaError(f"{out}: already exists; pass --overwrite to replace it")
            if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_FILE).is_file()):
                raise ZayaError(f"{out}: exists and is not a dataset; refusing to replace it")
        for stale in (*out.parent.glob(f".{out.name}.partial-*"), *out.parent.glob(f".{out.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
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

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        if len(doc_lengths) == 0:
            return
        if mask is not None:
            mask = mask.astype(np.uint8, copy=False)
            self.loss_tokens += int(np.count_nonzero(mask))
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
