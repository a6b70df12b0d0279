"""The batch-size ramp: the global batch size as a function of the samples consumed so far (Megatron's rule).

The batch starts at `start` and grows by `increment` each time another ramp_samples / n samples have been
consumed, where n = (final - start) / increment is the number of increments; past `ramp_samples` it stays at
`final`. Because it depends only on consumed samples, a resumed run continues the ramp where it left off.

Megatron computes floor(consumed / (ramp_samples / n)) in floating point; here it is the exact integer
floor(consumed * n / ramp_samples), which agrees everywhere except where rounding would misplace a step.
With start 32, increment 32, final 256 and 10,000 ramp samples: B(0) = 32, B(1500) = 64, B(5000) = 128,
B(9999) = 224 and B(10001) = 256.
"""

from __future__ import annotations

from dataclasses import dataclass

from zaya.errors import ZayaError


@dataclass(frozen=True)
class BatchRamp:
    """A linear batch-size ramp over consumed samples; `ramp_samples=0` or `start == final` means no ramp."""

    start: int
    increment: int
    final: int
    ramp_samples: int

    def __post_init__(self) -> None:
        for name in ("start", "increment", "final", "ramp_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ZayaError(f"batch ramp: '{name}' must be a non-negative integer, got {value!r}")
        if self.start < 1:
            raise ZayaError(f"batch ramp: 'start' must be at least 1, got {self.start}")
        if self.final < self.start:
            raise ZayaError(f"batch ramp: 'final' ({self.final}) is smaller than 'start' ({self.start})")
        if self.final > self.start:
            if self.increment < 1:
                raise ZayaError("batch ramp: 'increment' must be at least 1 when 'final' exceeds 'start'")
            if (self.final - self.start) % self.increment:
                raise ZayaError(f"batch ramp: final - start = {self.final - self.start} is not a multiple of "
                                f"the increment {self.increment}")

    @property
    def increments(self) -> int:
        """How many times the batch grows."""
        return (self.final - self.start) // self.increment if self.final > self.start else 0

    def at(self, consumed_samples: int) -> int:
        """The global batch size for the step that starts after `consumed_samples` samples."""
        if consumed_samples < 0:
            raise ZayaError(f"consumed samples must not be negative, got {consumed_samples}")
        if self.increments == 0 or consumed_samples > self.ramp_samples or self.ramp_samples == 0:
            return self.final
        steps = consumed_samples * self.increments // self.ramp_samples
        return min(self.start + steps * self.increment, self.final)

    def sizes(self) -> list[int]:
        """Every batch size the ramp passes through, smallest first."""
        return [self.start + i * self.increment for i in range(self.increments + 1)]

    def check_divisible(self, divisor: int, what: str = "the world size times the micro-batch size") -> None:
        """Refuse a ramp with a batch size that cannot be split evenly (into ranks and micro-batches)."""
        for size in self.sizes():
            if size % divisor:
                raise ZayaError(f"batch ramp: batch size {size} is not divisible by {divisor} ({what})")


def ramp_for(start: int, increment: int, final: int, ramp_samples: int) -> BatchRamp:
    """The ramp a run config asks for (`data.ramp_*`, `train.global_batch_size`): none when `ramp_samples`
    is 0 or the ramp starts at 0 or at the final size."""
    if ramp_samples == 0 or start in (0, final):
        return BatchRamp(final, 0, final, 0)
    return BatchRamp(start, increment, final, ramp_samples)


def batch_size_at(consumed_samples: int, start: int, increment: int, final: int, ramp_samples: int) -> int:
    """The global batch size after `consumed_samples` samples, under Megatron's ramp rule."""
    return BatchRamp(start, increment, final, ramp_samples).at(consumed_samples)
