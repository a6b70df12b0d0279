from fractions import Fraction

import pytest

from zaya.data.ramp import BatchRamp, batch_size_at
from zaya.errors import ZayaError


@pytest.mark.parametrize(("consumed", "expected"), [(0, 32), (1500, 64), (5000, 128), (9999, 224), (10001, 256)])
def test_issue_table(consumed, expected):
    assert batch_size_at(consumed, start=32, increment=32, final=256, ramp_samples=10_000) == expected


def test_matches_the_exact_megatron_rule_everywhere():
    ramp = BatchRamp(start=32, increment=32, final=256, ramp_samples=10_000)
    per_increment = Fraction(10_000, 7)
    for consumed in range(0, 12_000):
        exact = 256 if consumed > 10_000 else min(32 + int(Fraction(consumed) / per_increment) * 32, 256)
        assert ramp.at(consumed) == exact, consumed


def test_ramp_is_monotonic_and_visits_every_size():
    ramp = BatchRamp(start=8, increment=8, final=64, ramp_samples=1000)
    seen = [ramp.at(c) for c in range(0, 1200)]
    assert seen == sorted(seen)
    assert sorted(set(seen)) == ramp.sizes() == [8, 16, 24, 32, 40, 48, 56, 64]


def test_no_ramp():
    assert BatchRamp(start=64, increment=0, final=64, ramp_samples=0).at(0) == 64
    assert BatchRamp(start=16, increment=16, final=64, ramp_samples=0).at(0) == 64
    assert BatchRamp(start=64, increment=0, final=64, ramp_samples=500).sizes() == [64]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((32, 30, 256, 1000), "not a multiple of the increment"),
        ((256, 32, 32, 1000), "smaller than 'start'"),
        ((0, 32, 256, 1000), "'start' must be at least 1"),
        ((32, 0, 256, 1000), "'increment' must be at least 1"),
        ((32, 32, 256, -1), "'ramp_samples' must be a non-negative integer"),
    ],
)
def test_bad_ramps_are_refused(args, message):
    with pytest.raises(ZayaError, match=message):
        BatchRamp(*args)


def test_check_divisible():
    ramp = BatchRamp(start=6, increment=6, final=24, ramp_samples=100)
    ramp.check_divisible(3)
    with pytest.raises(ZayaError, match="batch size 6 is not divisible by 4"):
        ramp.check_divisible(4)
