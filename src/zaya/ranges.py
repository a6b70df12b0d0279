"""The range a number of a config must lie in: `Range(lo, hi)`, both bounds included unless `lo_open` or `hi_open`
says otherwise, and at most one value outside them that means something else (`also`: 0 for "none", -1 for "every
rank"). Written as a message and a document shows it: `1..65,536`, `(0, 10]`, `0 or [1, 1e+12]`."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    lo: int | float
    hi: int | float
    lo_open: bool = False
    hi_open: bool = False
    also: int | float | None = None

    def holds(self, value: int | float) -> bool:
        """Whether `value` (an int or a float, not a bool) lies in the range; never true of NaN or infinity."""
        if self.also is not None and value == self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def text(self, integer: bool) -> str:
        """`1..65,536` for an integer range, `[0, 1)` or `(0, 10]` for a range of numbers."""
        if integer:
            body = f"{number_text(self.lo)}..{number_text(self.hi)}"
        else:
            body = (f"{'(' if self.lo_open else '['}{number_text(self.lo)}, {number_text(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        return body if self.also is None else f"{number_text(self.also)} or {body}"


def number_text(value: int | float) -> str:
    """An int with thousands separators; a float that is a whole number below 1e9 as one; else as `:g` writes it."""
    if isinstance(value, int) or (math.isfinite(value) and float(value).is_integer() and abs(value) < 1e9):
        return f"{int(value):,}"
    return f"{value:g}"
