"""Learning-rate schedules: plain functions of the step returning a multiplier of the configured rate.

`step` counts the optimizer steps already taken (0 before the first). Every schedule warms up linearly,
m = (step + 1) / warmup_steps, so the first step already moves; after that:

    wsd       1 until the last `decay_steps` steps, which decay and end at `min_ratio`: the last step of the
              run (step == total_steps - 1) takes the final rate, t = 1:
              t = (step + 1 - (total_steps - decay_steps)) / decay_steps in (0, 1]
              linear: 1 - t     cosine: (1 + cos(pi t)) / 2     1-sqrt: 1 - sqrt(t)
    cosine    (1 + cos(pi t)) / 2 with t = (step - warmup_steps) / (total_steps - warmup_steps)
    constant  1

and the decayed value is min_ratio + (1 - min_ratio) * shape. Past total_steps the multiplier stays at
its final value. The trainer applies one multiplier to every param group (`set_lr_multiplier`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zaya.errors import ZayaError

if TYPE_CHECKING:  # the schedule itself is plain arithmetic: reading a config imports no torch
    from torch.optim import Optimizer

SCHEDULES = ("wsd", "cosine", "constant")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def warmup(step: int, warmup_steps: int) -> float:
    """The linear warmup factor (step + 1) / warmup_steps, 1 once warmed up (or without warmup)."""
    return 1.0 if step >= warmup_steps else (step + 1) / warmup_steps


def decay_shape(t: float, shape: str) -> float:
    """A decay from 1 at t = 0 to 0 at t = 1, of the given shape ("linear", "cosine" or "1-sqrt")."""
    t = min(max(t, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - t
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(t)
    raise ZayaError(f"schedule: 'decay_shape' must be one of {', '.join(DECAY_SHAPES)}, got {shape!r}")


def wsd(
    step: int,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    decay_steps: int = 0,
    shape: str = "linear",
    min_ratio: float = 0.0,
) -> float:
    """Warmup-stable-decay: warm up, hold 1, then decay over the last `decay_steps` steps, the last of which
    (step total_steps - 1) takes `min_ratio`."""
    decay_start = total_steps - decay_steps
    if decay_steps > 0 and step >= decay_start:
        return min_ratio + (1.0 - min_ratio) * decay_shape((step + 1 - decay_start) / decay_steps, shape)
    return warmup(step, warmup_steps)


def cosine(step: int, total_steps: int, *, warmup_steps: int = 0, min_ratio: float = 0.0) -> float:
    """Warm up, then one half cosine from 1 down to `min_ratio` at step == total_steps."""
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * decay_shape(t, "cosine")


@dataclass
class ScheduleConfig:
    """Which schedule, and its shape; validated on construction."""

    kind: str = "wsd"  # "wsd", "cosine" or "constant"
    total_steps: int = 1000  # the steps the schedule spans; a run config's default: train.max_steps
    warmup_steps: int = 0  # steps of linear warmup
    # wsd: the share of total_steps spent decaying; half by default: in runs of minutes to hours it ends lower
    # than a fifth (docs/benchmarks.md#time-to-quality); a long run sets less (zaya1-base: 0.1)
    decay_fraction: float = 0.5
    decay_shape: str = "1-sqrt"  # wsd: "linear", "cosine" or "1-sqrt"
    min_ratio: float = 0.0  # the final multiplier

    def __post_init__(self) -> None:
        self.validate()

    @property
    def decay_steps(self) -> int:
        return round(self.decay_fraction * self.total_steps)

    def validate(self, source: str = "schedule config") -> None:
        """Raise `ZayaError` naming the first field that cannot describe a schedule."""
        if self.kind not in SCHEDULES:
            raise ZayaError(f"{source}: field 'kind' must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        for name, least in (("total_steps", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ZayaError(f"{source}: field '{name}' must be an integer >= {least}, got {value!r}")
        for name in ("decay_fraction", "min_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ZayaError(f"{source}: field '{name}' must be a number in [0, 1], got {value!r}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ZayaError(
                f"{source}: field 'decay_shape' must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}"
            )
        decay = self.decay_steps if self.kind == "wsd" else 0
        if self.warmup_steps + decay > self.total_steps:
            raise ZayaError(
                f"{source}: field 'warmup_steps' ({self.warmup_steps}) plus the decay ({decay} steps) exceeds "
                f"total_steps ({self.total_steps})"
            )

    def multiplier(self, step: int) -> float:
        """The learning-rate multiplier before optimizer step `step` (0-based)."""
        if self.kind == "wsd":
            return wsd(
                step, self.total_steps, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                shape=self.decay_shape, min_ratio=self.min_ratio,
            )  # fmt: skip
        if self.kind == "cosine":
            return cosine(step, self.total_steps, warmup_steps=self.warmup_steps, min_ratio=self.min_ratio)
        return warmup(step, self.warmup_steps)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "schedule config") -> ScheduleConfig:
        """Build from a dict (a config file's section), refusing unknown fields with a message naming `source`."""
        if not isinstance(data, dict):
            raise ZayaError(f"{source}: expected an object, got {type(data).__name__}")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ZayaError(f"{source}: unknown field '{unknown[0]}'")
        config = cls.__new__(cls)
        for name, f in fields.items():
            setattr(config, name, data.get(name, f.default))
        config.validate(source)
        return config


def set_lr_multiplier(optimizer: Optimizer, multiplier: float) -> None:
    """Set every param group's `lr` to its `initial_lr` (its configured rate) times `multiplier`."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * multiplier
