"""Which keys a query may see, in one place: causal, inside its packed document, within a sliding window.

Query t of a row sees key s iff

    first_t <= s <= t   and   t - s < window          (first_t = t - pos_t: where t's document starts)

(`window` None: no window; a row without packed documents is one document). The mask is never formed as a
[T, T] tensor. `DocumentLayout` holds where each row's documents start, on the host (the data loader has the
tokens there before they reach the device, so nothing is read back), and cuts the allowed (query, key) pairs
into *segments*: rectangles of consecutive queries and keys, each of one of three kinds,

    CAUSAL   a square on the diagonal, q0 = k0 and q1 = k1: key s seen by query t iff s <= t
    FULL     every key by every query (keys of the query's document, before the query range)
    MASKED   the rule above evaluated over the rectangle: runs of short documents packed together, and the
             band of a sliding window

so that the attention's work follows the documents, about sum(len_i^2) / 2 rather than T^2 / 2: a key block
that shares no document with a query block is not in any segment. Every allowed pair lies in exactly one
segment. The kernels that run the segments are in `zaya.model.segment_attention`; context parallelism asks for
the segments of one pair of chunks (`DocumentLayout.segments` with a query and a key range).

A segment is a row of a [n, 6] int64 array: (row, q0, q1, k0, k1, kind), in global token indices; row -1
stands for every row, where all rows have the same documents (one each, without packing).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

CAUSAL, FULL, MASKED = 0, 1, 2
KINDS = ("causal", "full", "masked")

# Documents shorter than this are packed with their neighbours into MASKED segments of up to `_PACK_TOKENS`
# tokens: a segment's kernel calls cost more than a few tokens' attention (forward and backward about 0.2 ms on
# a CPU core whatever the size, and a pack's mask 0.08 ms more). Rows of 8k tokens, 8 query heads of dim 128 on
# one core: documents of 4 tokens take 0.39 s alone, 0.22 s in packs of 64, 0.30 s in packs of 128; of 24
# tokens 0.20 s alone or packed; mixes of mean length 25 and 100 within 5% for packs of 64 below 16 or 32 tokens.
_PACK_BELOW = 16
_PACK_TOKENS = 64
# A document longer than the sliding window runs as query tiles of about the window's size (at least
# `_MIN_TILE`, at most `_MAX_TILE` tokens), each over its band of keys: about 2 x window keys per query.
_MIN_TILE, _MAX_TILE = 64, 512


@dataclass(frozen=True)
class DocumentLayout:
    """Where the documents of each row of a batch start (`starts[b]`, ascending, 0 first) in rows of `length`
    tokens, and the sliding window (None: none). Host-side: plain Python integers."""

    starts: tuple[tuple[int, ...], ...]
    length: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window of {self.window} tokens; it must be at least 1")
        if not self.starts:
            raise ValueError("a document layout of no rows")
        for row in self.starts:
            if not row or row[0] != 0 or any(b <= a for a, b in itertools.pairwise(row)) or row[-1] >= self.length:
                raise ValueError(f"document starts {row[:8]}... are not ascending from 0 below {self.length}")

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor | np.ndarray, separator: int | None,
                    window: int | None = None) -> DocumentLayout:
        """The layout of token rows [B, T] (on the host) whose documents each end with `separator` (the token
        after one starts a document); `separator` None: one document per row."""
        rows = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
        if rows.ndim != 2:
            raise ValueError(f"token rows must be [B, T], got shape {tuple(rows.shape)}")
        B, T = rows.shape
        if separator is None:
            return cls(((0,),) * B, T, window)
        after = rows[:, :-1] == separator
        return cls(tuple((0, *(np.flatnonzero(after[b]) + 1).tolist()) for b in range(B)), T, window)

    @property
    def batch(self) -> int:
        return len(self.starts)

    def lengths(self, row: int) -> list[int]:
        """The lengths of row `row`'s documents (the last one may be cut by the row's end)."""
        bounds = (*self.starts[row], self.length)
        return [b - a for a, b in itertools.pairwise(bounds)]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Each token's position in its document [B, T] (int64): RoPE's positions and the convolutions' reach."""
        out = np.empty((self.batch, self.length), dtype=np.int64)
        for b, row in enumerate(self.starts):
            bounds = (*row, self.length)
            for a, e in itertools.pairwise(bounds):
                out[b, a:e] = np.arange(e - a)
        return torch.from_numpy(out).to(device)

    def pairs(self) -> int:
        """The (query, key) pairs the mask allows over the whole batch: the work of an exact kernel."""
        total = 0
        for b in range(self.batch):
            for n in self.lengths(b):
                total += band_pairs(n, self.window)
        return total

    def segments(self, queries: tuple[int, int] | None = None, keys: tuple[int, int] | None = None) -> np.ndarray:
        """The segments [n, 6] that cover exactly the allowed pairs of queries [q0, q1) and keys [k0, k1) of
        every row (both default to the whole row). The key range either is the query range or ends at or
        before its start (a chunk against itself, or against an earlier chunk)."""
        q0, q1 = queries if queries is not None else (0, self.length)
        k0, k1 = keys if keys is not None else (q0, q1)
        if not (0 <= q0 < q1 <= self.length and 0 <= k0 < k1 <= self.length):
            raise ValueError(f"ranges [{q0}, {q1}) and [{k0}, {k1}) do not lie in rows of {self.length} tokens")
        same = (k0, k1) == (q0, q1)
        if not same and k1 > q0:
            raise ValueError(f"keys [{k0}, {k1}) neither are the queries [{q0}, {q1}) nor end before them")
        out: list[tuple[int, ...]] = []
        rows = list(enumerate(self.starts))
        if all(row == self.starts[0] for row in self.starts):
            rows = [(-1, self.starts[0])]
        for b, row in rows:
            if same:
                self._diagonal(b, row, q0, q1, out)
            else:
                self._before(b, row, q0, q1, k0, k1, out)
        return np.asarray(out, dtype=np.int64).reshape(-1, 6)

    # ---- the two cases ------------------------------------------------------------------------------

    def _documents_in(self, row: tuple[int, ...], q0: int, q1: int) -> list[tuple[int, int]]:
        """The documents of a row clipped to [q0, q1), as (start, end); q0 starts one (a chunk's first token
        is where its share of the document crossing into it starts)."""
        i = int(np.searchsorted(row, q0, side="right"))
        bounds = [q0, *(s for s in row[i:] if s < q1), q1]
        return list(itertools.pairwise(bounds))

    def _diagonal(self, b: int, row: tuple[int, ...], q0: int, q1: int, out: list) -> None:
        """Queries and keys [q0, q1): each document's causal square (a band of tiles under a window); short
        documents packed with their neighbours."""
        W = self.window
        pack: list[tuple[int, int]] = []  # the short documents gathered so far

        def flush() -> None:
            if len(pack) == 1 and (W is None or pack[0][1] - pack[0][0] <= W):
                out.append((b, *pack[0], *pack[0], CAUSAL))
            elif pack:
                out.append((b, pack[0][0], pack[-1][1], pack[0][0], pack[-1][1], MASKED))
            pack.clear()

        for s, e in self._documents_in(row, q0, q1):
            n = e - s
            if n < _PACK_BELOW:
                if pack and e - pack[0][0] > _PACK_TOKENS:
                    flush()
                pack.append((s, e))
                continue
            flush()
            if W is None or n <= W:
                out.append((b, s, e, s, e, CAUSAL))
                continue
            tile = min(_MAX_TILE, max(_MIN_TILE, W))
            for a in range(s, e, tile):  # a band: each tile of queries over the keys its window reaches
                z = min(a + tile, e)
                out.append((b, a, z, max(s, a - W + 1), z, MASKED))
        flush()

    def _before(self, b: int, row: tuple[int, ...], q0: int, q1: int, k0: int, k1: int, out: list) -> None:
        """Queries [q0, q1) against the earlier keys [k0, k1): only the document that crosses q0 reaches back,
        its queries [q0, e) over its keys from max(its start, k0)."""
        i = int(np.searchsorted(row, q0, side="right")) - 1
        first = row[i]
        end = min(row[i + 1] if i + 1 < len(row) else self.length, q1)
        if first >= k1:
            return
        ks = max(first, k0)
        W = self.window
        if W is None or (end - 1) - ks < W:  # every pair within the window
            out.append((b, q0, end, ks, k1, FULL))
        elif q0 - (k1 - 1) < W:  # some pairs within it: the queries that reach the keys at all
            out.append((b, q0, min(end, k1 - 1 + W), max(ks, q0 - W + 1), k1, MASKED))


@functools.lru_cache(maxsize=32)
def window_segments(length: int, window: int) -> torch.Tensor:
    """The segments of rows of `length` tokens, one document each, under a sliding `window` (row -1: every row):
    the plan of a sliding block without packed documents, made once per shape (a host tensor; read, never
    written)."""
    return torch.from_numpy(DocumentLayout(((0,),), length, window).segments())


def band_pairs(n: int, window: int | None) -> int:
    """Pairs (t, s), s <= t < n, t - s < window: a causal square of side n under a window."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def segment_work(segments: np.ndarray, batch: int) -> int:
    """The (query, key) pairs a kernel computes for `segments` of a batch of `batch` rows: a causal square's
    triangle, a rectangle's area (MASKED segments compute their whole rectangle)."""
    if len(segments) == 0:
        return 0
    lq = segments[:, 2] - segments[:, 1]
    lk = segments[:, 4] - segments[:, 3]
    causal = segments[:, 5] == CAUSAL
    rows = np.where(segments[:, 0] < 0, batch, 1)
    return int((np.where(causal, lq * (lq + 1) // 2, lq * lk) * rows).sum())


def allowed(q0: int, q1: int, k0: int, k1: int, first: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q1 - q0, k1 - k0] bool: which keys [k0, k1) queries [q0, q1) may see, the queries' documents starting at
    `first` [q1 - q0] (global indices), or with `first` of no elements one document per row, starting before
    every key. The one place the rule is written as tensors; for a MASKED segment only."""
    ok = band_mask(q1 - q0, k1 - k0, q0 - k0, window, first.device)
    if first.numel():
        ok = ok & (torch.arange(k0, k1, device=first.device)[None, :] >= first[:, None])
    return ok


@functools.lru_cache(maxsize=64)
def band_mask(queries: int, keys: int, offset: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool: causal and within `window`, query i being `offset` positions after key i. Made once
    per shape (every full tile of a sliding block's band has the same one); read, never written."""
    t = torch.arange(queries, device=device)[:, None] + offset
    s = torch.arange(keys, device=device)[None, :]
    ok = s <= t
    if window is not None:
        ok &= t - s < window
    return ok
