"""Context-parallel work with packed documents: the attention work of each chunk of a sequence, and chunks dealt
out to the ranks so that each computes about the same.

Head-tail sharding (`zaya.parallel.context`) evens out the causal mask's work: rank r holds chunks r and
2 cp - 1 - r, an early chunk whose queries see few keys with a late one whose queries see many. With packed
documents kept apart a query sees only the keys of its own document, so a chunk's work no longer follows its
index: a chunk inside a long document costs far more than one holding a run of short ones, wherever it lies.
Under head-tail the busiest rank then computes 1.2-1.9x the mean rank's query-key pairs (lognormal document
lengths, 32k and 131k tokens, cp 4 and 8: `benchmarks/cp_balance.py`), and every rank waits for it.

A phase that keeps documents apart therefore cuts each sequence into cp x K chunks (K =
`parallel.cp_document_chunks`) and deals them out by work, the greedy rule for equal loads with equal counts
(the largest chunk first, each to the least loaded rank that still needs one, until every rank holds K), then
swaps chunks between the busiest rank and the others while that lowers it (`swap`). Ties go to the lower index,
and the work is counted in integers, so every rank of a cp group plans the same layout from the same tokens
without a word to the others.

The work of chunk c (tokens [c L, c L + L)) is what the attention computes for its queries, over the rows of
the micro-batch (one layout serves all of them): against its own keys, the causal triangle of each document
clipped to the chunk; against the earlier chunks, the rectangle of the one document that crosses the chunk's
first token, its queries in the chunk over its keys before it. In closed form, per row:

    work(c) = sum over the pieces n of documents in the chunk of  n (n + 1) / 2   +   (e - c L) (c L - s)

where [s, e) is the document holding token c L, e cut at the chunk's end. These are the pairs that
`DocumentLayout.segments` plans for the chunk against itself and every earlier chunk, as `segment_work` counts
them, except that a run of documents shorter than 16 tokens runs as one masked rectangle (a few more pairs).
The sliding window is left out: a windowed layer's work is at most a window per query, nearly even already;
the unwindowed layers' are what needs balancing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from zaya.model.masks import DocumentLayout


def chunk_work(documents: DocumentLayout, num_chunks: int) -> np.ndarray:
    """[num_chunks] int64: the query-key pairs of each chunk's queries (against its own keys and every earlier
    chunk's), summed over the rows of `documents`, for rows cut into `num_chunks` chunks of equal length."""
    T = documents.length
    if num_chunks < 1 or T % num_chunks:
        raise ValueError(f"rows of {T} tokens do not split into {num_chunks} chunks of equal length")
    L = T // num_chunks
    begins = np.arange(0, T, L, dtype=np.int64)  # each chunk's first token
    work = np.zeros(num_chunks, dtype=np.int64)
    rows = documents.starts
    if all(row == rows[0] for row in rows):  # one computation for a batch of equal rows (one document each)
        rows, repeat = rows[:1], len(rows)
    else:
        repeat = 1
    for row in rows:
        starts = np.asarray(row, dtype=np.int64)
        # the chunk against itself: the documents cut at the chunk bounds, a triangle each
        cuts = np.union1d(starts, begins)
        pieces = np.diff(cuts, append=T)
        work += np.add.reduceat(pieces * (pieces + 1) // 2, np.searchsorted(cuts, begins))
        # against the earlier chunks: the document that holds each chunk's first token, back to its start
        holder = np.searchsorted(starts, begins, side="right") - 1
        first = starts[holder]
        end = np.minimum(np.append(starts, T)[holder + 1], begins + L)
        work += (end - begins) * (begins - first)
    return work * repeat


def deal(work: np.ndarray | list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """The chunks of each rank (ascending, len(work) / ranks each), dealt out by `work`: `greedy`, then `swap`."""
    return swap(work, greedy(work, ranks))


def greedy(work: np.ndarray | list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """The chunks of each rank (ascending, len(work) / ranks each): the largest chunk first, each to the least
    loaded rank that still needs one (ties: the lower chunk index, the lower rank)."""
    work = [int(w) for w in work]
    if ranks < 1 or len(work) % ranks:
        raise ValueError(f"{len(work)} chunks do not split into {ranks} equal shares")
    per_rank = len(work) // ranks
    loads, held = [0] * ranks, [[] for _ in range(ranks)]
    for chunk in sorted(range(len(work)), key=lambda c: (-work[c], c)):
        rank = min((r for r in range(ranks) if len(held[r]) < per_rank), key=lambda r: loads[r])
        loads[rank] += work[chunk]
        held[rank].append(chunk)
    return tuple(tuple(sorted(chunks)) for chunks in held)


def swap(work: np.ndarray | list[int], assignment: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """`assignment` improved by swaps of one chunk of the busiest rank for a lighter one of another rank, each
    time the swap that leaves the lower of the two ranks' larger load, while one lowers it below the busiest's.

    The greedy deal ends with no choice left: the ranks still short of chunks take the last, smallest ones
    whatever their loads, so that a rank holding one dear chunk gets as many more as the others. Swaps fix
    that: at 8 chunks per rank the busiest rank then ends within 0.1% of the mean in the median row, or at the
    bound no layout can beat (its dearest chunk and the K - 1 cheapest), where a single chunk outweighs a rank's
    share. Every swap lowers the sorted loads, so it ends; integers and fixed tie-breaks keep it the same on
    every rank."""
    work = np.asarray(work, dtype=np.int64)
    held = np.array(assignment, dtype=np.int64)  # [ranks, K]
    for _ in range(4 * held.size):  # a bound, far above the swaps a real deal makes
        loads = work[held].sum(axis=1)
        top = int(np.argmax(loads))
        # d[i, r, j]: the load moved from the busiest rank to rank r by swapping its i-th chunk for r's j-th
        d = work[held[top]][:, None, None] - work[held][None, :, :]
        larger = np.maximum(loads[top] - d, loads[None, :, None] + d)
        useful = (d > 0) & (larger < loads[top])
        useful[:, top, :] = False
        if not useful.any():
            break
        i, r, j = np.unravel_index(int(np.argmin(np.where(useful, larger, np.iinfo(np.int64).max))), d.shape)
        held[top, i], held[r, j] = held[r, j], held[top, i]
    return tuple(tuple(sorted(int(c) for c in chunks)) for chunks in held)


def rank_work(work: np.ndarray, assignment: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """[ranks] int64: the work of each rank's chunks under `assignment`."""
    return np.array([int(sum(work[c] for c in chunks)) for chunks in assignment], dtype=np.int64)


def imbalance(loads: np.ndarray) -> float:
    """The busiest rank's work over the mean rank's (1.0: even; every rank waits for the busiest)."""
    mean = float(np.mean(loads))
    return float(np.max(loads)) / mean if mean > 0 else 1.0
