"""Reading a split's tokens: random access to its stream across the shard files, windows gathered in bulk,
and read-ahead advice to the operating system."""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from zaya.data.shards import SplitEntry

_CAN_ADVISE = hasattr(os, "posix_fadvise")


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
