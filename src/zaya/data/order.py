"""The global sample order: which sample each position of training sees, independent of the number of ranks.

A source is one split of one dataset cut into samples: sample i is the window of seq_len + 1 tokens starting
at token i * seq_len of the split's token stream (neighbouring windows share one token: the last label of one
is the first input of the next). The order is an endless sequence of (source, sample) pairs, built in two
levels so that it is random at the scale of a batch yet reads few places on disk:

1. Blocks. Each source is cut into blocks of `block_size` consecutive samples (its last, incomplete block is
   not used: fewer than block_size samples per source). Every epoch of a source visits all its blocks in a
   fresh permutation seeded by (seed, source fingerprint, epoch). The sources' block sequences are
   interleaved by weight, block by block: a smooth weighted round robin in which source s takes exactly
   w_s of every period of blocks (weights are kept to a resolution of 2**-16), each source cycling through
   its own epochs.
2. Groups. Each run of `group_blocks` consecutive blocks of that stream is a group, and the group's
   S = group_blocks * block_size samples are shuffled together, seeded by (seed, sources, group number).

Position p is entry p mod S of group p // S, so any position is found without replaying the order, and a
consumer's whole state is the number of positions it has passed, `consumed_samples`. Groups may straddle the
boundary between two epochs of a source.

Locality bound. A block is one contiguous range of a source's token stream (block_size * seq_len + 1
tokens). A global batch of B consecutive positions meets at most ceil((B - 1) / S) + 1 groups, each made of
group_blocks blocks, so all its samples lie in at most

    min(B, group_blocks * (ceil((B - 1) / S) + 1))

distinct contiguous byte ranges (fewer when blocks happen to be neighbours). With the defaults (block_size 64,
group_blocks 32, S = 2048), any batch of up to 2049 samples touches at most 64 ranges of 64 samples each.
Skipped positions count as part of the batch's span: a batch with k skipped positions obeys the bound for
B + k. (A range lies in one super-shard file, except where it crosses from one file into the next.)

When a source has fewer than block_size samples, the block size shrinks to the smallest source's sample
count, and a group never holds more blocks than one epoch of all sources has.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from zaya.data.config import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_BLOCKS
from zaya.errors import ZayaError
from zaya.schema import shown

WEIGHT_RESOLUTION = 1 << 16
_BLOCKS_TAG = 1
_GROUP_TAG = 2
_CACHED_GROUPS = 4

SkipRanges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class OrderSource:
    """What the order needs to know about a source: its size, its share, and its identity."""

    num_samples: int
    weight: float
    fingerprint: str


def normalize_skip_ranges(ranges: Iterable[Sequence[int]]) -> SkipRanges:
    """Skip ranges as sorted, merged half-open [start, stop) pairs of positions."""
    pairs = []
    for item in ranges:
        if (not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2
                or not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in item)
                or not 0 <= item[0] < item[1] < 2**63):
            raise ZayaError(f"skip range {shown(item)}: expected [start, stop) with 0 <= start < stop < 2**63")
        pairs.append((int(item[0]), int(item[1])))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(pairs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return tuple(merged)


def _identity(text: str) -> int:
    """A fingerprint (or any string) as a 128-bit integer for seeding."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:16], "little")


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(words))))


class _Interleave:
    """Smooth weighted round robin over sources, with O(1) random access.

    Source s gets an integer share n_s of every period of P = sum(n_s) slots, its k-th slot of a period
    placed at time (2k + 1) / n_s; slots are ordered by time, ties by source. Any slot's source and the
    number of earlier slots of that source follow from the period number and one precomputed table."""

    def __init__(self, weights: Sequence[float]) -> None:
        total = float(sum(weights))
        shares = np.array([max(1, round(w / total * WEIGHT_RESOLUTION)) for w in weights], dtype=np.int64)
        self.shares = shares // np.gcd.reduce(shares)
        self.period = int(self.shares.sum())
        sources = np.repeat(np.arange(len(weights)), self.shares)
        index = np.concatenate([np.arange(n) for n in self.shares])
        # (2k + 1) / n_s in float64 is exact enough: distinct times differ by at least 2**-32, far above
        # the rounding error at these magnitudes, and equal times round identically.
        times = (2 * index + 1) / self.shares[sources]
        self.sequence = sources[np.lexsort((sources, times))]
        self.before = np.zeros((len(weights), self.period + 1), dtype=np.int64)
        self.before[:, 1:] = np.cumsum(self.sequence[None, :] == np.arange(len(weights))[:, None], axis=1)

    def locate(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each slot, its source and how many slots that source had before it."""
        periods, offsets = np.divmod(slots, self.period)
        sources = self.sequence[offsets]
        return sources, periods * self.shares[sources] + self.before[sources, offsets]


class GlobalOrder:
    """The two-level block-shuffled order over weighted sources; see the module docstring."""

    def __init__(self, sources: Sequence[OrderSource], seed: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 group_blocks: int = DEFAULT_GROUP_BLOCKS) -> None:
        if not sources:
            raise ZayaError("a data order needs at least one source")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ZayaError(f"seed must be a non-negative integer, got {seed!r}")
        if block_size < 1 or group_blocks < 1:
            raise ZayaError(f"block_size and group_blocks must be positive, got {block_size} and {group_blocks}")
        for i, source in enumerate(sources):
            if source.num_samples < 1:
                raise ZayaError(f"source {i} ({source.fingerprint[:16]}) has no samples")
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ZayaError(f"source {i}: weight must be a positive number, got {source.weight}")
        self.sources = tuple(sources)
        self.seed = seed
        self.block_size = min(block_size, min(s.num_samples for s in sources))
        self.blocks_per_epoch = [s.num_samples // self.block_size for s in sources]
        self.group_blocks = min(group_blocks, sum(self.blocks_per_epoch))
        self.group_samples = self.group_blocks * self.block_size
        self._interleave = _Interleave([s.weight for s in sources])
        self._identities = [_identity(s.fingerprint) for s in sources]
        mixture = "|".join(f"{s.fingerprint}:{n}" for s, n in zip(sources, self._interleave.shares, strict=True))
        self._mixture = _identity(mixture)
        self._permutations: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def locality_bound(self, batch_size: int) -> int:
        """The most distinct contiguous ranges (blocks) a batch of `batch_size` consecutive positions touches."""
        groups = -(-(batch_size - 1) // self.group_samples) + 1
        return min(batch_size, self.group_blocks * groups)

    def take(self, start: int, count: int, skip_ranges: SkipRanges = ()) -> tuple[np.ndarray, int]:
        """The next `count` positions from `start` that are not skipped, and the position after the last."""
        parts = []
        position, need = start, count
        for skip_start, skip_stop in skip_ranges:
            if need == 0:
                break
            if skip_stop <= position:
                continue
            if skip_start > position:
                n = min(need, skip_start - position)
                parts.append(np.arange(position, position + n, dtype=np.int64))
                position += n
                need -= n
                if need == 0:
                    break
            position = skip_stop
        if need:
            parts.append(np.arange(position, position + need, dtype=np.int64))
            position += need
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), position

    def lookup(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (source index, sample index) at each position."""
        positions = np.asarray(positions, dtype=np.int64)
        groups, offsets = np.divmod(positions, self.group_samples)
        sources = np.empty(len(positions), dtype=np.int64)
        samples = np.empty(len(positions), dtype=np.int64)
        for group in np.unique(groups).tolist():
            where = np.flatnonzero(groups == group)
            group_sources, group_samples = self._group(group)
            sources[where] = group_sources[offsets[where]]
            samples[where] = group_samples[offsets[where]]
        return sources, samples

    def _group(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        if group in self._groups:
            self._groups.move_to_end(group)
            return self._groups[group]
        slots = np.arange(group * self.group_blocks, (group + 1) * self.group_blocks, dtype=np.int64)
        sources, ordinals = self._interleave.locate(slots)
        blocks = np.empty(len(slots), dtype=np.int64)
        for source in np.unique(sources).tolist():
            where = np.flatnonzero(sources == source)
            epochs, indices = np.divmod(ordinals[where], self.blocks_per_epoch[source])
            for epoch in np.unique(epochs).tolist():
                chosen = epochs == epoch
                blocks[where[chosen]] = self._permutation(source, epoch)[indices[chosen]]
        samples = (blocks[:, None] * self.block_size + np.arange(self.block_size)).ravel()
        sources = np.repeat(sources, self.block_size)
        shuffle = _rng(self.seed, _GROUP_TAG, self._mixture, group).permutation(self.group_samples)
        entry = (sources[shuffle], samples[shuffle])
        self._groups[group] = entry
        if len(self._groups) > _CACHED_GROUPS:
            self._groups.popitem(last=False)
        return entry

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        """The block order of one epoch of one source: depends only on (seed, fingerprint, epoch)."""
        key = (source, epoch)
        if key not in self._permutations:
            rng = _rng(self.seed, _BLOCKS_TAG, self._identities[source], epoch)
            self._permutations[key] = rng.permutation(self.blocks_per_epoch[source])
            # a source needs at most its current and next epoch at a time
            if len(self._permutations) > 2 * len(self.sources):
                self._permutations.popitem(last=False)
        else:
            self._permutations.move_to_end(key)
        return self._permutations[key]
