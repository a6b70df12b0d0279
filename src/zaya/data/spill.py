"""Tokens on their way from a worker process to the dataset writer: files in the build's staging directory.

A worker appends each batch of documents it has tokenized (a chunk: their tokens and lengths, per split) to
its job's files as it goes, and returns only the chunk sizes; the main process copies the chunks into the
dataset one at a time and deletes the files. Neither process ever holds a whole job's tokens, however large
the job (a compressed file is one job), and results that finish out of order wait on disk, not in memory.
A chat build's chunks also have a loss mask, one byte per token, in a third file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from zaya.data.shards import SPLITS

_LENGTHS = np.dtype("<i8")
_MASK = np.dtype("u1")


@dataclass
class SpilledTokens:
    """Where a job's tokens are, and the size of each chunk: (documents, tokens) per split."""

    prefix: str
    dtype: str
    masked: bool = False
    chunks: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {split: [] for split in SPLITS})

    def paths(self, split: str) -> tuple[Path, Path, Path]:
        """The token file, the document-length file and the loss-mask file of a split."""
        return (Path(f"{self.prefix}.{split}.tokens"), Path(f"{self.prefix}.{split}.docs"),
                Path(f"{self.prefix}.{split}.mask"))

    def read(self, split: str):
        """The chunks of a split, in order, as (tokens, document lengths, loss mask or None) arrays."""
        chunks = self.chunks[split]
        if not chunks:
            return
        tokens_path, docs_path, mask_path = self.paths(split)
        with contextlib.ExitStack() as stack:
            tokens, docs = stack.enter_context(open(tokens_path, "rb")), stack.enter_context(open(docs_path, "rb"))
            mask = stack.enter_context(open(mask_path, "rb")) if self.masked else None
            for num_documents, num_tokens in chunks:
                yield (np.fromfile(tokens, dtype=np.dtype(self.dtype).newbyteorder("<"), count=num_tokens),
                       np.fromfile(docs, dtype=_LENGTHS, count=num_documents),
                       None if mask is None else np.fromfile(mask, dtype=_MASK, count=num_tokens))

    def remove(self) -> None:
        """Delete the files (after the chunks were copied, or when the build fails)."""
        for split in SPLITS:
            for path in self.paths(split):
                path.unlink(missing_ok=True)


class SpillWriter:
    """Appends a job's chunks to its files, opened on first use."""

    def __init__(self, prefix: str, dtype: str, masked: bool = False) -> None:
        self.spilled = SpilledTokens(prefix, dtype, masked)
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._files: dict[str, tuple[BinaryIO, ...]] = {}

    def write(self, split: str, tokens: np.ndarray, doc_lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append one chunk of documents (with their loss mask, in a masked spill) to a split."""
        if len(doc_lengths) == 0:
            return
        if (mask is not None) != self.spilled.masked:
            raise ValueError("a masked spill takes a mask with every chunk, an unmasked one none")
        if split not in self._files:
            paths = self.spilled.paths(split)[:3 if self.spilled.masked else 2]
            self._files[split] = tuple(open(path, "wb") for path in paths)  # noqa: SIM115 - see close()
        tokens_file, docs_file, *mask_file = self._files[split]
        tokens_file.write(tokens.astype(self._dtype, copy=False).tobytes())
        docs_file.write(doc_lengths.astype(_LENGTHS, copy=False).tobytes())
        if mask is not None:
            mask_file[0].write(mask.astype(_MASK, copy=False).tobytes())
        self.spilled.chunks[split].append((len(doc_lengths), len(tokens)))

    def close(self) -> SpilledTokens:
        """Close the files; returns where the chunks are."""
        for handles in self._files.values():
            for handle in handles:
                handle.close()
        self._files.clear()
        return self.spilled
