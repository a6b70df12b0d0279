"""Learning-rate schedules: values at the phase boundaries, the decay shapes, config checks, application."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zaya.errors import ZayaError
from zaya.optim.hybrid import build_optimizer
from zaya.optim.schedule import ScheduleConfig, cosine, set_lr_multiplier, wsd


def test_wsd_phases():
    # 100 steps (0 .. 99): warmup 10, stable to step 79, linear decay over the last 20, step 99 at 0.1
    values = [wsd(s, 100, warmup_steps=10, decay_steps=20, shape="linear", min_ratio=0.1) for s in range(101)]
    assert values[0] == pytest.approx(0.1) and values[4] == pytest.approx(0.5) and values[9] == 1.0
    assert all(v == 1.0 for v in values[9:80]) and values[80] < 1.0
    assert values[89] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[99] == pytest.approx(0.1) and values[100] == pytest.approx(0.1)  # the last step's rate is final
    assert all(a >= b for a, b in itertools.pairwise(values[9:]))


@pytest.mark.parametrize(
    ("shape", "at_quarter"), [("linear", 0.75), ("cosine", (1 + math.cos(math.pi / 4)) / 2), ("1-sqrt", 0.5)]
)
def test_decay_shapes(shape, at_quarter):
    assert wsd(59, 100, decay_steps=40, shape=shape) == pytest.approx(1.0)
    assert wsd(69, 100, decay_steps=40, shape=shape) == pytest.approx(at_quarter)
    assert wsd(99, 100, decay_steps=40, shape=shape) == pytest.approx(0.0)
    assert wsd(150, 100, decay_steps=40, shape=shape) == pytest.approx(0.0)


def test_cosine():
    assert cosine(0, 110, warmup_steps=10) == pytest.approx(0.1)
    assert cosine(10, 110, warmup_steps=10) == pytest.approx(1.0)
    assert cosine(60, 110, warmup_steps=10, min_ratio=0.2) == pytest.approx(0.6)
    assert cosine(110, 110, warmup_steps=10, min_ratio=0.2) == pytest.approx(0.2)


def test_schedule_config():
    config = ScheduleConfig(kind="wsd", total_steps=1000, warmup_steps=100, decay_fraction=0.1, decay_shape="linear")
    assert config.decay_steps == 100
    assert config.multiplier(0) == pytest.approx(0.01)
    assert config.multiplier(500) == 1.0
    assert config.multiplier(949) == pytest.approx(0.5) and config.multiplier(999) == 0.0
    assert ScheduleConfig(kind="constant", warmup_steps=4).multiplier(1) == pytest.approx(0.5)
    assert ScheduleConfig(kind="cosine", total_steps=10).multiplier(5) == pytest.approx(0.5)
    assert ScheduleConfig.from_dict({"kind": "cosine", "total_steps": 10}) == ScheduleConfig("cosine", 10)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": "step"}, "kind"),
        ({"total_steps": 0}, "total_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"decay_fraction": 1.5}, "decay_fraction"),
        ({"decay_shape": "exp"}, "decay_shape"),
        ({"min_ratio": -0.1}, "min_ratio"),
        ({"total_steps": 100, "warmup_steps": 90, "decay_fraction": 0.2}, "warmup_steps"),
    ],
)
def test_schedule_config_errors_name_the_field(changes, field):
    with pytest.raises(ZayaError, match=f"field '{field}'"):
        ScheduleConfig(**changes)
    with pytest.raises(ZayaError, match="unknown field 'steps'"):
        ScheduleConfig.from_dict({"steps": 10})


def test_one_multiplier_serves_every_group():
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = build_optimizer(model)
    optimizer.param_groups[0]["initial_lr"] = 0.3
    set_lr_multiplier(optimizer, 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
    set_lr_multiplier(optimizer, 1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3)
