"""Training batches for one rank: the global order, sliced after it is built, read ahead in the background.

    loader = TokenLoader([("data/web", 0.7), ("data/code", 0.3)], seq_len=2048, seed=1234,
                         rank=rank, world_size=world_size)
    loader.load_state_dict(saved)                      # on resume, from any world size
    for step in ...:
        batch = loader.next_batch(ramp.at(loader.consumed_samples))   # [B / world_size, seq_len + 1] int64
        inputs, labels = inputs_and_targets(batch, IGNORE_INDEX)      # zaya.data.loss_mask
    save(loader.state_dict())

A chat dataset's loss mask comes inside the batch: the tokens the model must not learn to produce are stored
complemented, as negative ids (`zaya.data.loss_mask` says why); a batch of unmasked data is plain ids, and in
a mixture the rows of unmasked sources count every token.

Every rank computes the same global batch, the next B positions of the global order (skipped positions
left out), and keeps its contiguous slice: rank r of W gets entries [r * B / W, (r + 1) * B / W). The
ranks' slices, concatenated in rank order, are therefore exactly the batch a single process would see, and
the loader's state is just `consumed_samples` and the skip ranges: resuming with any world size continues
the same sequence of global batches.

Batches are planned in chunks of up to 64 batches or about a million tokens. For the chunks after the
current one (`prefetch` of them), a background thread asks the operating system to read the blocks they will
touch into memory (`posix_fadvise(WILLNEED)`, so a step does not wait for the disk); the current chunk is
gathered from strided views of the memory-mapped shards in one vectorised copy per shard, and `next_batch`
widens its batch to int64. Building a batch from resident pages costs about what a sequential read of the
same bytes does, and the thread does so little that it hardly competes with training for the interpreter lock.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zaya.data.config import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_BLOCKS
from zaya.data.dataset_reader import Dataset, open_dataset
from zaya.data.loss_mask import mark
from zaya.data.order import (
    GlobalOrder,
    OrderSource,
    SkipRanges,
    normalize_skip_ranges,
)
from zaya.data.split_tokens import SplitTokens
from zaya.errors import ZayaError
from zaya.schema import shown

STATE_VERSION = 1
DEFAULT_PREFETCH = 2  # chunks prefetched beyond the one being handed out
# a chunk is large enough to amortise planning and gathering, small enough to stay in cache and to be
# thrown away cheaply when the batch size changes
_CHUNK_TOKENS = 1 << 20
_CHUNK_BATCHES = 64
_SOURCE_SHIFT = 40  # a block's key: source << 40 | block number
# the fields of a saved state that must match the loader it is loaded into
_IDENTITY_FIELDS = ("seed", "seq_len", "split", "block_size", "group_blocks", "sources")


@dataclass
class _Chunk:
    """Consecutive batches of one size, planned together and handed out one at a time."""

    start: int  # global position of the first batch
    batch_size: int
    stops: list[int]  # consumed_samples after each batch
    sources: np.ndarray  # this rank's rows of all the batches: (source, sample) of each
    samples: np.ndarray
    advice: concurrent.futures.Future | None  # the background request to read its new blocks into memory
    positions: np.ndarray  # [batches, batch_size] global positions of the order, every rank's
    rows: np.ndarray | None = None  # [batches * share, seq_len + 1] tokens as stored, once gathered
    masks: np.ndarray | None = None  # their loss mask (uint8), if a source has one
    taken: int = 0

    @property
    def next_start(self) -> int:
        return self.start if self.taken == 0 else self.stops[self.taken - 1]


class TokenLoader:
    """Per-rank batches of fixed windows of seq_len + 1 tokens from a weighted mixture of datasets.

    sources: (dataset directory or opened `Dataset`, weight) pairs, all made with one tokenizer.
    seq_len, seed: with the sources' fingerprints and weights, these fix the global order.
    split: the split to draw batches from (normally "train").
    rank, world_size: this process's slice of every global batch; not part of the state.
    consumed_samples, skip_ranges: where to start, and global positions never to return.
    block_size, group_blocks: the two-level shuffle (see `zaya.data.order`); part of the state.
    prefetch: chunks of batches whose blocks are read into memory ahead of use.
    """

    def __init__(
        self,
        sources: Sequence[tuple[str | Path | Dataset, float]],
        seq_len: int,
        seed: int,
        *,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        consumed_samples: int = 0,
        skip_ranges: Sequence[Sequence[int]] = (),
        block_size: int = DEFAULT_BLOCK_SIZE,
        group_blocks: int = DEFAULT_GROUP_BLOCKS,
        prefetch: int = DEFAULT_PREFETCH,
    ) -> None:
        if not sources:
            raise ZayaError("the loader needs at least one (dataset, weight) source")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ZayaError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not 0 <= rank < world_size:
            raise ZayaError(f"rank {rank} is not in [0, world_size={world_size})")
        self.datasets = [d if isinstance(d, Dataset) else open_dataset(d) for d, _ in sources]
        self.weights = [_weight(w) for _, w in sources]
        _check_same_tokenizer(self.datasets)
        self.seq_len = seq_len
        self.seed = seed
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self._splits = [d.split(split) for d in self.datasets]
        # whether batches carry a loss mask (see the module docstring): a chat dataset among the sources
        self.has_loss_mask = any(d.has_loss_mask for d in self.datasets)
        for dataset, tokens in zip(self.datasets, self._splits, strict=True):
            if tokens.num_tokens < seq_len + 1:
                raise ZayaError(f"{dataset.path}: the {split} split has {tokens.num_tokens} tokens, fewer than "
                                f"one sample of seq_len + 1 = {seq_len + 1}")
        self.order = GlobalOrder(
            [OrderSource(num_windows(t.num_tokens, seq_len), w, d.fingerprint)
             for d, t, w in zip(self.datasets, self._splits, self.weights, strict=True)],
            seed, block_size, group_blocks,
        )
        self.block_size = block_size
        self.group_blocks = group_blocks
        self._consumed = _non_negative(consumed_samples, "consumed_samples")
        self._skip_ranges = normalize_skip_ranges(skip_ranges)
        self._prefetch = max(0, prefetch)
        self._pending: deque[_Chunk] = deque()
        self._last_blocks = np.zeros(0, dtype=np.int64)
        # the global positions of the last batch handed out (all ranks' rows): the record of what was trained
        self.last_positions = np.zeros(0, dtype=np.int64)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zaya-data")

    # ---- state ----------------------------------------------------------------------------------------

    @property
    def consumed_samples(self) -> int:
        """Positions of the global order passed so far (trained on or skipped), across all ranks."""
        return self._consumed

    @property
    def skip_ranges(self) -> SkipRanges:
        """Global positions [start, stop) never returned."""
        return self._skip_ranges

    def add_skip_range(self, start: int, stop: int) -> None:
        """Never return positions [start, stop); every other position keeps its place in the order."""
        self._skip_ranges = normalize_skip_ranges([*self._skip_ranges, (start, stop)])
        self._discard_pending()

    def state_dict(self) -> dict:
        """The loader's state as JSON-ready data; the rank and world size are deliberately not part of it."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": self._consumed,
            "skip_ranges": [list(r) for r in self._skip_ranges],
            **self._identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; it must come from a loader over the same data, seed and seq_len."""
        if not isinstance(state, dict):
            raise ZayaError(f"loader state must be a JSON object, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ZayaError(f"loader state: version {state.get('version')!r}, this zaya reads {STATE_VERSION}")
        mine = self._identity()
        for key in _IDENTITY_FIELDS:
            if key not in state:
                raise ZayaError(f"loader state: missing field '{key}'")
            if state[key] != mine[key]:
                raise ZayaError(f"loader state: '{key}' is {state[key]!r}, but this loader has {mine[key]!r}; "
                                "a resume needs the same data, seed, sequence length and blocks")
        self._consumed = _non_negative(state.get("consumed_samples"), "loader state: consumed_samples")
        ranges = state.get("skip_ranges", [])
        if not isinstance(ranges, list) or not all(isinstance(item, list) for item in ranges):
            raise ZayaError(f"loader state: skip_ranges must be a list of [start, stop) pairs, got {shown(ranges)}")
        self._skip_ranges = normalize_skip_ranges(ranges)
        self._discard_pending()

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "split": self.split,
            "block_size": self.block_size,
            "group_blocks": self.group_blocks,
            "sources": [{"fingerprint": d.fingerprint, "weight": w} for d, w in zip(self.datasets, self.weights,
                                                                                  strict=True)],
        }

    # ---- batches --------------------------------------------------------------------------------------

    def next_batch(self, global_batch_size: int) -> torch.Tensor:
        """This rank's share of the next global batch: [global_batch_size // world_size, seq_len + 1] int64, the
        tokens a loss mask leaves out complemented (`zaya.data.loss_mask`)."""
        pending = self._pending
        if not (pending and pending[0].batch_size == global_batch_size
                and pending[0].next_start == self._consumed):
            # the first batch, a new batch size (a ramp step), or a state that was just loaded
            self._check_batch_size(global_batch_size)
            self._discard_pending()
            self._plan(self._consumed, global_batch_size)
        while len(pending) <= self._prefetch:
            self._plan(pending[-1].stops[-1], global_batch_size)
        chunk = pending[0]
        if chunk.rows is None:
            chunk.rows, chunk.masks = self._read(chunk.sources, chunk.samples)
        share = global_batch_size // self.world_size
        taken = slice(chunk.taken * share, (chunk.taken + 1) * share)
        batch = torch.from_numpy(mark(chunk.rows[taken].astype(np.int64),
                                      None if chunk.masks is None else chunk.masks[taken]))
        self.last_positions = chunk.positions[chunk.taken]
        self._consumed = chunk.stops[chunk.taken]
        chunk.taken += 1
        if chunk.taken == len(chunk.stops):
            pending.popleft()
        return batch

    def _check_batch_size(self, global_batch_size: int) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ZayaError(f"global batch size must be a positive integer, got {global_batch_size!r}")
        if global_batch_size % self.world_size:
            raise ZayaError(f"global batch size {global_batch_size} is not divisible by the world size "
                            f"{self.world_size}")

    def _plan(self, start: int, batch_size: int) -> None:
        """Plan the next few batches of `batch_size` from global position `start`, and prefetch their blocks."""
        share = batch_size // self.world_size
        count = min(_CHUNK_BATCHES, max(1, _CHUNK_TOKENS // (share * (self.seq_len + 1))))
        positions, _ = self.order.take(start, count * batch_size, self._skip_ranges)
        grid = positions.reshape(count, batch_size)
        # a batch ends right after its last position, exactly as if the batches were taken one at a time
        stops = (grid[:, -1] + 1).tolist()
        sources, samples = self.order.lookup(grid[:, self.rank * share:(self.rank + 1) * share].ravel())
        # Prefetch whole blocks, the unit the order reads in; consecutive chunks mostly share a group's
        # blocks, so only blocks the previous chunk did not touch are new.
        blocks = np.unique(sources << _SOURCE_SHIFT | samples // self.order.block_size)
        fresh = np.setdiff1d(blocks, self._last_blocks, assume_unique=True)
        self._last_blocks = blocks
        advice = self._executor.submit(self._advise, fresh) if len(fresh) else None
        self._pending.append(_Chunk(start, batch_size, stops, sources, samples, advice, grid))

    def _advise(self, blocks: np.ndarray) -> None:
        """Ask the OS to read these (source << _SOURCE_SHIFT | block) blocks into memory."""
        span = self.order.block_size * self.seq_len
        for source in np.unique(blocks >> _SOURCE_SHIFT).tolist():
            tokens = self._splits[source]
            mine = blocks[blocks >> _SOURCE_SHIFT == source] & ((1 << _SOURCE_SHIFT) - 1)
            tokens.advise([(b * span, min((b + 1) * span + 1, tokens.num_tokens)) for b in mine.tolist()])

    def _read(self, sources: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of a chunk, in the stored token dtype (every source has the same tokenizer, so the same), and
        their loss mask if a source has one (all ones for the rows of sources without)."""
        return _gather(self._splits, sources, samples, self.seq_len, self.has_loss_mask)

    def _discard_pending(self) -> None:
        for chunk in self._pending:
            if chunk.advice is not None:
                chunk.advice.cancel()
        self._pending.clear()
        self._last_blocks = np.zeros(0, dtype=np.int64)

    # ---- evaluation -----------------------------------------------------------------------------------

    def iter_eval_batches(self, batch_size: int, *, split: str = "val",
                          max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Fixed evaluation batches: consecutive windows of every source's `split`, in source order, cut into
        global batches of `batch_size` (an incomplete last batch is dropped); this rank's slice of each.

        The same arguments give the same batches every time, whatever the training state. A loss mask comes
        as in `next_batch`."""
        if batch_size < 1 or batch_size % self.world_size:
            raise ZayaError(f"eval batch size {batch_size} must be a positive multiple of the world size "
                            f"{self.world_size}")
        splits = [d.split(split) for d in self.datasets]
        counts = np.array([num_windows(t.num_tokens, self.seq_len) for t in splits], dtype=np.int64)
        num_batches = int(counts.sum()) // batch_size
        if num_batches == 0:
            raise ZayaError(f"the {split} split has {int(counts.sum())} windows of {self.seq_len + 1} tokens, "
                            f"fewer than one eval batch of {batch_size}")
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        starts = np.concatenate([[0], np.cumsum(counts)])
        share = batch_size // self.world_size
        for b in range(num_batches):
            first = b * batch_size + self.rank * share
            windows = np.arange(first, first + share)
            sources = np.searchsorted(starts, windows, side="right") - 1
            rows, masks = _gather(splits, sources, windows - starts[sources], self.seq_len, self.has_loss_mask)
            yield torch.from_numpy(mark(rows.astype(np.int64), masks))

    # ---- checks and lifetime --------------------------------------------------------------------------

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse a model whose vocabulary cannot embed every token id of every source."""
        for dataset in self.datasets:
            dataset.check_vocab(model_vocab_size)

    def close(self) -> None:
        """Stop the background reader."""
        self._discard_pending()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _gather(splits: Sequence[SplitTokens], sources: np.ndarray, samples: np.ndarray, seq_len: int,
            masked: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Windows `samples` of the sources' splits (row i from `splits[sources[i]]`) in the stored dtype, and with
    `masked` their loss masks, all ones for a split without one (unmasked data counts every token)."""
    if len(splits) == 1:
        return splits[0].gather(samples, seq_len), splits[0].gather_mask(samples, seq_len) if masked else None
    out = np.empty((len(samples), seq_len + 1), dtype=splits[0].dtype)
    masks = np.ones((len(samples), seq_len + 1), dtype=np.uint8) if masked else None
    for source in np.unique(sources).tolist():
        rows = np.flatnonzero(sources == source)
        out[rows] = splits[source].gather(samples[rows], seq_len)
        if masks is not None and splits[source].has_loss_mask:
            masks[rows] = splits[source].gather_mask(samples[rows], seq_len)
    return out, masks


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of `seq_len + 1` tokens that `num_tokens` consecutive tokens give, each sharing its edge token with
    the next: what an evaluation takes of a split."""
    return max(0, (num_tokens - 1) // seq_len)


def _non_negative(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ZayaError(f"{name} must be a non-negative integer (below 2**63), got {shown(value)}")
    return value


def _weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ZayaError(f"a source weight must be a number, got {value!r}")
    return float(value)


def _check_same_tokenizer(datasets: Sequence[Dataset]) -> None:
    first = datasets[0]
    for other in datasets[1:]:
        if other.tokenizer_sha256 != first.tokenizer_sha256:
            raise ZayaError(f"{other.path}: made with a different tokenizer than {first.path} "
                            f"({other.tokenizer_sha256[:12]} vs {first.tokenizer_sha256[:12]}); a mixture needs "
                            "one tokenizer")
