"""Reading a split's tokens: random access to its stream across the shard files, windows gathered in bulk,
and read-ahead advice to the operating system. A chat dataset's loss mask is a second stream with the same
shard boundaries, read the same way: `gather_mask` gives the mask windows of the windows `gather` gives."""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from zaya.data.shards import SplitEntry
from zaya.errors import ZayaError

_CAN_ADVISE = hasattr(os, "posix_fadvise")


class SplitTokens:
    """Random access to one split's token stream (and loss mask, if it has one) through read-only memory maps of
    its shards."""

    def __init__(self, directory: Path, entry: SplitEntry, dtype: np.dtype, max_token_id: int | None = None) -> None:
        self.name = entry.name
        self.max_token_id = max_token_id  # what the manifest promises; a window holding more is refused
        self._shard_files = [directory / f.file for f in entry.shards]
        self.num_tokens = entry.num_tokens
        self.num_documents = entry.num_documents
        self._docs_path = directory / entry.documents.file
        self.dtype = dtype
        self._starts = [0, *np.cumsum(entry.shard_tokens).tolist()]
        self._tokens = _Stream(directory, entry.shards, dtype, self._starts)
        self._mask = None if entry.masks is None else _Stream(directory, entry.masks, np.dtype(np.uint8),
                                                              self._starts)
        for fd in self._tokens.fds + (self._mask.fds if self._mask else []):
            weakref.finalize(self, os.close, fd)

    @property
    def has_loss_mask(self) -> bool:
        """Whether every token has a loss-mask flag (a chat dataset's split)."""
        return self._mask is not None

    def advise(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Ask the operating system to start reading token ranges [start, stop) (and their mask) into memory, and
        return at once. A no-op where posix_fadvise is unavailable."""
        if not _CAN_ADVISE:
            return
        ranges = list(ranges)
        for stream in (self._tokens, self._mask):
            if stream is not None:
                stream.advise(ranges)

    def gather(self, samples: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows of seq_len + 1 tokens as an array [len(samples), seq_len + 1] of the stored dtype; window i
        is tokens [i * seq_len, i * seq_len + seq_len + 1).

        Windows are gathered from strided views of the shards in one vectorised copy per shard; the few that
        cross from one shard file into the next are read piecewise. A token id above the manifest's
        `max_token_id` (a file altered after its checksum was taken, or a lying manifest) raises `ZayaError`
        naming the shard and the position: it would index past the model's embedding."""
        out = self._tokens.gather(samples, seq_len, self.name)
        if self.max_token_id is not None and out.size and int(out.max()) > self.max_token_id:
            row, column = (int(i) for i in np.unravel_index(int(np.argmax(out > self.max_token_id)), out.shape))
            offset = int(samples[row]) * seq_len + column
            shard = bisect.bisect_right(self._starts, offset) - 1
            raise ZayaError(f"{self._shard_files[shard]}: token id {int(out[row, column])} at position "
                            f"{offset - self._starts[shard]} is above the manifest's max_token_id "
                            f"{self.max_token_id}")
        return out

    def gather_mask(self, samples: np.ndarray, seq_len: int) -> np.ndarray | None:
        """The loss mask of the windows `gather` gives, [len(samples), seq_len + 1] uint8 (1: a token the model
        learns to produce); None for a split without a mask."""
        return None if self._mask is None else self._mask.gather(samples, seq_len, self.name)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, as a new array of the stored dtype."""
        out = np.empty(stop - start, dtype=self.dtype)
        self.read_into(out, start)
        return out

    def read_mask(self, start: int, stop: int) -> np.ndarray | None:
        """The loss mask of tokens [start, stop) (None for a split without a mask)."""
        if self._mask is None:
            return None
        out = np.empty(stop - start, dtype=np.uint8)
        self._mask.read_into(out, start, self.name)
        return out

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill `out` (any integer dtype) with the tokens from `start` on."""
        self._tokens.read_into(out, start, self.name)

    def document_ends(self) -> np.ndarray:
        """Where each document ends in the stream (document i spans ends[i-1]..ends[i])."""
        if self.num_documents == 0:
            return np.zeros(0, dtype=np.int64)
        return np.memmap(self._docs_path, dtype="<i8", mode="r")


class _Stream:
    """One flat array cut into shard files (the tokens, or their mask): memory maps, read-ahead descriptors and
    strided window views."""

    def __init__(self, directory: Path, files: Iterable, dtype: np.dtype, starts: list[int]) -> None:
        files = list(files)
        self.dtype = dtype
        self.starts = starts
        # plain ndarrays over the mappings: np.memmap's Python-level indexing costs microseconds per call
        self.maps = [np.asarray(np.memmap(directory / f.file, dtype=dtype, mode="r")) for f in files]
        # descriptors for read-ahead advice; posix_fadvise, unlike mmap.madvise, releases the GIL
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # never waits on a FIFO put in a shard's place
        self.fds = [os.open(directory / f.file, flags) for f in files] if _CAN_ADVISE else []
        self._windows: dict[int, list[tuple[int, np.ndarray]]] = {}

    def advise(self, ranges: list[tuple[int, int]]) -> None:
        itemsize = self.dtype.itemsize
        for start, stop in ranges:
            shard = bisect.bisect_right(self.starts, start) - 1
            while start < stop:
                end = min(stop, self.starts[shard + 1])
                offset = (start - self.starts[shard]) * itemsize
                length = (end - start) * itemsize
                os.posix_fadvise(self.fds[shard], offset, length, os.POSIX_FADV_WILLNEED)
                start, shard = end, shard + 1

    def gather(self, samples: np.ndarray, seq_len: int, name: str) -> np.ndarray:
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
            self.read_into(out[row], int(samples[row]) * seq_len, name)
        return out

    def _window_views(self, seq_len: int) -> list[tuple[int, np.ndarray]]:
        """Per shard: the index of the first window lying wholly inside it, and a [count, seq_len + 1] view of
        those windows (neighbouring rows overlap by one token)."""
        if seq_len not in self._windows:
            views = []
            for tokens, start in zip(self.maps, self.starts, strict=False):
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

    def read_into(self, out: np.ndarray, start: int, name: str) -> None:
        stop = start + len(out)
        if start < 0 or stop > self.starts[-1]:
            raise IndexError(f"tokens [{start}, {stop}) are outside the {name} split of {self.starts[-1]}")
        shard = bisect.bisect_right(self.starts, start) - 1
        done = 0
        while done < len(out):
            offset = start + done - self.starts[shard]
            take = min(len(out) - done, self.starts[shard + 1] - self.starts[shard] - offset)
            out[done:done + take] = self.maps[shard][offset:offset + take]
            done += take
            shard += 1
