import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from zaya.data.order import GlobalOrder, OrderSource, normalize_skip_ranges
from zaya.errors import ZayaError

FP_A = "a" * 64
FP_B = "b" * 64


def _digest(order: GlobalOrder, count: int) -> str:
    sources, samples = order.lookup(np.arange(count))
    return hashlib.sha256(sources.tobytes() + samples.tobytes()).hexdigest()


def test_two_processes_produce_identical_orders():
    sources = [OrderSource(5000, 0.7, FP_A), OrderSource(3000, 0.3, FP_B)]
    here = _digest(GlobalOrder(sources, seed=11, block_size=16, group_blocks=8), 20_000)
    script = (
        "import hashlib, numpy as np\n"
        "from zaya.data.order import GlobalOrder, OrderSource\n"
        f"o = GlobalOrder([OrderSource(5000, 0.7, {FP_A!r}), OrderSource(3000, 0.3, {FP_B!r})], seed=11, "
        "block_size=16, group_blocks=8)\n"
        "s, i = o.lookup(np.arange(20000))\n"
        "print(hashlib.sha256(s.tobytes() + i.tobytes()).hexdigest())\n"
    )
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert there.strip() == here


def test_order_depends_on_seed_and_fingerprint():
    base = _digest(GlobalOrder([OrderSource(4000, 1.0, FP_A)], seed=1), 4000)
    assert _digest(GlobalOrder([OrderSource(4000, 1.0, FP_A)], seed=1), 4000) == base
    assert _digest(GlobalOrder([OrderSource(4000, 1.0, FP_A)], seed=2), 4000) != base
    assert _digest(GlobalOrder([OrderSource(4000, 1.0, FP_B)], seed=1), 4000) != base


def test_an_epoch_visits_every_sample_once():
    # 64 blocks of 16, groups of 8 blocks: the first 1024 positions are exactly epoch 0
    order = GlobalOrder([OrderSource(64 * 16 + 5, 1.0, FP_A)], seed=3, block_size=16, group_blocks=8)
    sources, samples = order.lookup(np.arange(64 * 16))
    assert set(sources.tolist()) == {0}
    assert sorted(samples.tolist()) == list(range(64 * 16))
    assert samples.tolist() != sorted(samples.tolist())
    # the next epoch is a different permutation of the same samples
    _, again = order.lookup(np.arange(64 * 16, 2 * 64 * 16))
    assert sorted(again.tolist()) == list(range(64 * 16)) and again.tolist() != samples.tolist()


def _ranges(order: GlobalOrder, sources: np.ndarray, samples: np.ndarray) -> int:
    """Distinct contiguous sample ranges that hold these samples, at block granularity: touched blocks,
    with neighbouring blocks of one source merged into one range."""
    count = 0
    for source in np.unique(sources):
        blocks = np.unique(samples[sources == source] // order.block_size)
        count += 1 + int(np.sum(np.diff(blocks) > 1))
    return count


@pytest.mark.parametrize(
    ("sources", "block_size", "group_blocks"),
    [
        ([OrderSource(20_000, 1.0, FP_A)], 16, 4),
        ([OrderSource(20_000, 1.0, FP_A)], 64, 32),
        ([OrderSource(9_000, 0.6, FP_A), OrderSource(7_000, 0.4, FP_B)], 8, 6),
    ],
)
def test_batches_stay_under_the_locality_bound(sources, block_size, group_blocks):
    order = GlobalOrder(sources, seed=5, block_size=block_size, group_blocks=group_blocks)
    rng = np.random.default_rng(0)
    worst = 0
    for batch_size in (1, 7, 32, 100, 256, 1000):
        bound = order.locality_bound(batch_size)
        assert bound == min(batch_size, group_blocks * (-(-(batch_size - 1) // (block_size * group_blocks)) + 1))
        for start in rng.integers(0, 50_000, size=20).tolist():
            sources_, samples = order.lookup(np.arange(start, start + batch_size))
            ranges = _ranges(order, sources_, samples)
            assert ranges <= bound
            worst = max(worst, ranges / bound)
    # the bound is close to what happens: batches really are spread over many places
    assert worst > 0.5


def test_mixture_shares_are_exact_per_period():
    order = GlobalOrder([OrderSource(10_000, 3.0, FP_A), OrderSource(10_000, 1.0, FP_B)], seed=0,
                        block_size=10, group_blocks=8)
    sources, _ = order.lookup(np.arange(0, 8 * 10 * 25))
    assert np.bincount(sources).tolist() == [1500, 500]
    # interleaved smoothly: every group of 8 blocks already has the 3:1 split
    for group in sources.reshape(25, 80):
        assert np.bincount(group).tolist() == [60, 20]


def test_small_sources_shrink_the_blocks():
    order = GlobalOrder([OrderSource(5, 1.0, FP_A)], seed=0, block_size=64, group_blocks=32)
    assert (order.block_size, order.group_blocks) == (5, 1)
    _, samples = order.lookup(np.arange(10))
    assert sorted(samples[:5].tolist()) == list(range(5))


def test_take_skips_and_keeps_positions():
    order = GlobalOrder([OrderSource(1000, 1.0, FP_A)], seed=0)
    skips = normalize_skip_ranges([(5, 8), (10, 11), (9, 10)])
    assert skips == ((5, 8), (9, 11))
    positions, stop = order.take(3, 6, skips)
    assert positions.tolist() == [3, 4, 8, 11, 12, 13] and stop == 14
    positions, stop = order.take(0, 5, skips)
    assert positions.tolist() == [0, 1, 2, 3, 4] and stop == 5
    positions, stop = order.take(5, 1, skips)
    assert positions.tolist() == [8] and stop == 9


@pytest.mark.parametrize("bad", [(3, 3), (-1, 4), (5, 2), (1,), (1.5, 3)])
def test_bad_skip_ranges_are_refused(bad):
    with pytest.raises(ZayaError, match="skip range"):
        normalize_skip_ranges([bad])


def test_bad_order_arguments():
    with pytest.raises(ZayaError, match="weight must be a positive number"):
        GlobalOrder([OrderSource(100, 0.0, FP_A)], seed=0)
    with pytest.raises(ZayaError, match="seed must be a non-negative integer"):
        GlobalOrder([OrderSource(100, 1.0, FP_A)], seed=-1)
    with pytest.raises(ZayaError, match="has no samples"):
        GlobalOrder([OrderSource(0, 1.0, FP_A)], seed=0)
    assert json.dumps(list(normalize_skip_ranges([(1, 2)]))) == "[[1, 2]]"
