"""The mask's planner (`zaya.model.masks`): the segments of a row, and of every pair of chunks a context-parallel
split makes of it, cover exactly the (query, key) pairs the mask allows, each once, none outside; their work
follows the documents; bad layouts and ranges are refused."""

import itertools

import numpy as np
import pytest
import torch

from zaya.model import masks
from zaya.model.documents import document_positions
from zaya.model.masks import CAUSAL, FULL, MASKED, DocumentLayout, allowed, segment_work


def _layout(seed: int, window: int | None) -> DocumentLayout:
    """1-3 rows of up to 200 tokens: one-token documents, documents longer than a pack or a window tile, of
    the window's length and one more, runs of short ones, the last one cut by the row's end; rows with
    different starts, or all with the same."""
    rng = np.random.default_rng(seed)
    B, T = int(rng.integers(1, 4)), int(rng.integers(1, 201))
    near = [] if window is None else [window, window + 1]
    rows = []
    for _ in range(B):
        starts = [0]
        while True:
            n = int(rng.choice([1, 1, 2, int(rng.integers(3, 31)), int(rng.integers(31, 90)), 150, *near]))
            if starts[-1] + n >= T:
                break
            starts.append(starts[-1] + n)
        rows.append(tuple(starts))
    if rng.random() < 0.3:
        rows = [rows[0]] * B
    return DocumentLayout(tuple(rows), T, window)


def _dense(layout: DocumentLayout) -> np.ndarray:
    """The mask as a [B, T, T] bool array, from `allowed`: the reference the segments must cover."""
    T = layout.length
    first = torch.arange(T) - layout.positions()
    return np.stack([allowed(0, T, 0, T, first[b], layout.window).numpy() for b in range(layout.batch)])


def _paint(layout: DocumentLayout, table: np.ndarray, counts: np.ndarray, reference: np.ndarray) -> None:
    """Add each segment's computed pairs to `counts` [B, T, T]; a CAUSAL or FULL segment must hold only allowed
    pairs (it has no mask), and every query of a segment must see a key in it (the kernels need one)."""
    for row, q0, q1, k0, k1, kind in table.tolist():
        assert 0 <= q0 < q1 <= layout.length and 0 <= k0 < k1 <= layout.length
        for b in range(layout.batch) if row < 0 else [row]:
            ok = reference[b, q0:q1, k0:k1]
            if kind == CAUSAL:
                assert (q0, q1) == (k0, k1)
                computed = np.tril(np.ones((q1 - q0, q1 - q0), dtype=bool))
                assert not (computed & ~ok).any(), (row, q0, q1, "causal beyond the mask")
            elif kind == FULL:
                computed = np.ones_like(ok)
                assert ok.all(), (row, q0, q1, k0, k1, "full beyond the mask")
            else:
                assert kind == MASKED
                computed = ok
            assert computed.any(axis=1).all(), (row, q0, q1, k0, k1, "a query without keys")
            counts[b, q0:q1, k0:k1] += computed


def _chunks(layout: DocumentLayout, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    T = layout.length
    cuts = sorted(set(rng.integers(1, T, size=min(T - 1, int(rng.integers(1, 6)))).tolist())) if T > 1 else []
    return list(itertools.pairwise([0, *cuts, T]))


WINDOWS = [None, 1, 3, 70, 1000]


@pytest.mark.parametrize("window", WINDOWS)
def test_the_segments_cover_exactly_the_allowed_pairs(window):
    for seed in range(100):
        layout = _layout(seed, window)
        reference = _dense(layout)
        whole = np.zeros(reference.shape, dtype=np.int64)
        _paint(layout, layout.segments(), whole, reference)
        np.testing.assert_array_equal(whole, reference.astype(np.int64), err_msg=f"seed {seed}")
        # a context-parallel split: each chunk against itself and against each earlier chunk
        split = np.zeros(reference.shape, dtype=np.int64)
        chunks = _chunks(layout, seed)
        for i, queries in enumerate(chunks):
            for keys in chunks[: i + 1]:
                _paint(layout, layout.segments(queries, keys), split, reference)
        np.testing.assert_array_equal(split, reference.astype(np.int64), err_msg=f"seed {seed}, chunks {chunks}")


def test_the_work_follows_the_documents():
    """Without a window the work is the exact pairs plus the packs' rectangles; with one, at most a band of
    tiles twice the window wide."""
    for seed, window in itertools.product(range(100), WINDOWS):
        layout = _layout(seed, window)
        exact = int(_dense(layout).sum())
        assert layout.pairs() == exact
        work = segment_work(layout.segments(), layout.batch)
        assert work >= exact
        short = sum(n for b in range(layout.batch) for n in layout.lengths(b) if n < masks._PACK_BELOW)
        if window is None or window >= layout.length:
            assert work <= exact + masks._PACK_TOKENS * short, (seed, window, work, exact)
        elif window >= masks._MIN_TILE:
            assert work <= 2.5 * exact + masks._PACK_TOKENS * short, (seed, window, work, exact)


def test_a_long_row_of_short_documents_costs_their_pairs():
    """8k tokens in documents of mean length 256: about sum(len^2)/2, not T^2/2; one document: T(T+1)/2."""
    rng = np.random.default_rng(0)
    starts = np.cumsum(rng.integers(1, 512, size=64))
    layout = DocumentLayout(((0, *starts[starts < 8192].tolist()),), 8192)
    work = segment_work(layout.segments(), 1)
    assert layout.pairs() <= work <= 1.01 * layout.pairs() < 8192 * 8193 // 2 / 10
    whole = DocumentLayout(((0,),), 8192)
    assert segment_work(whole.segments(), 1) == whole.pairs() == 8192 * 8193 // 2
    assert len(whole.segments()) == 1


def test_rows_with_the_same_documents_share_their_segments():
    same = DocumentLayout(((0, 5, 40),) * 3, 64)
    assert (same.segments()[:, 0] == -1).all()
    assert segment_work(same.segments(), 3) == same.pairs()
    other = DocumentLayout(((0, 5, 40), (0, 6, 40)), 64)
    assert set(other.segments()[:, 0].tolist()) == {0, 1}


def test_a_lone_short_document_is_a_causal_square_and_short_ones_pack():
    table = DocumentLayout(((0, 40, 45, 100),), 140).segments().tolist()
    assert [0, 40, 45, 40, 45, CAUSAL] in [[max(r[0], 0), *r[1:]] for r in table]
    packed = DocumentLayout(((0, *range(10, 60, 5)),), 60).segments()
    assert len(packed) == 1 and packed[0, 5] == MASKED


def test_the_layout_of_tokens_matches_the_device_positions():
    tokens = torch.tensor([[5, 1, 7, 8, 1, 1, 9], [4, 4, 4, 4, 4, 4, 1]])
    layout = DocumentLayout.from_tokens(tokens, separator=1)
    assert layout.starts == ((0, 2, 5, 6), (0,))
    assert torch.equal(layout.positions(), document_positions(tokens, 1))
    assert layout.lengths(0) == [2, 3, 1, 1]
    assert DocumentLayout.from_tokens(tokens, None).starts == ((0,), (0,))


@pytest.mark.parametrize("starts, length, window, message", [
    (((1, 5),), 10, None, "not ascending from 0"),
    (((0, 5, 5),), 10, None, "not ascending from 0"),
    (((0, 7, 3),), 10, None, "not ascending from 0"),
    (((0, 10),), 10, None, "not ascending from 0"),
    (((),), 10, None, "not ascending from 0"),
    ((), 10, None, "no rows"),
    (((0,),), 10, 0, "sliding window of 0"),
])
def test_bad_layouts_are_refused(starts, length, window, message):
    with pytest.raises(ValueError, match=message):
        DocumentLayout(starts, length, window)


@pytest.mark.parametrize("queries, keys, message", [
    ((0, 11), None, "do not lie in rows"),
    ((-1, 4), None, "do not lie in rows"),
    ((4, 4), None, "do not lie in rows"),
    ((4, 8), (0, 5), "neither are the queries"),
    ((4, 8), (8, 10), "neither are the queries"),
    ((4, 8), (4, 7), "neither are the queries"),
])
def test_bad_ranges_are_refused(queries, keys, message):
    with pytest.raises(ValueError, match=message):
        DocumentLayout(((0, 3),), 10).segments(queries, keys)


def test_token_rows_must_be_a_matrix():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        DocumentLayout.from_tokens(torch.tensor([1, 2, 3]), separator=1)
