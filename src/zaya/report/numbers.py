"""Numbers for people: counts with thousands separators, floats to 3-4 significant digits, percentages,
durations and byte sizes. Every function takes None or NaN and shows it as a dash."""

from __future__ import annotations

import math

MISSING = "–"  # en dash: what a table shows for a value it does not have


def _finite(value) -> float | None:
    """The value as a float, or None for None, NaN, booleans and anything that is not a number."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def count(value) -> str:
    """An integer count with thousands separators: 1234567 -> "1,234,567" (floats are rounded)."""
    number_ = _finite(value)
    if number_ is None:
        return MISSING
    if math.isinf(number_):
        return "inf" if number_ > 0 else "-inf"
    return f"{round(number_):,}"


def number(value, digits: int = 4) -> str:
    """A float to `digits` significant digits in plain notation (2.513, 0.1250, 123.4), in whole units with
    thousands separators from 1,000 on (12,346), and in scientific notation with 3 significant digits below
    0.01 and from 1e12 on (8.00e-3, 1.00e-9, 2.50e15)."""
    x = _finite(value)
    if x is None:
        return MISSING
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 999.5 <= abs(x) < 1e12:  # whole units: rounding 1,234,567.8 to 4 digits would invent zeros
        return f"{x:,.0f}"
    x = float(f"{x:.{digits}g}")  # round first, so that 999.96 is formatted as the 1,000 it rounds to
    if abs(x) < 1e-2 or abs(x) >= 1e12:
        mantissa, exponent = f"{x:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def percent(fraction, digits: int = 3) -> str:
    """A fraction as a percentage to `digits` significant digits: 0.01523 -> "1.52%"."""
    x = _finite(fraction)
    return MISSING if x is None else f"{number(x * 100, digits)}%"


def _special(x: float | None, fmt) -> str:
    """What a unit formatter shows for a missing, negative or infinite value (`fmt` formats the magnitude)."""
    if x is None:
        return MISSING
    if x < 0:
        return "-" + fmt(-x)
    return "inf"


def duration(seconds) -> str:
    """A time span: "12.3 ms", "0.84 s", "42.5 s", "4 min 12 s", "1 h 02 min", "2 d 03 h"."""
    x = _finite(seconds)
    if x is None or x < 0 or math.isinf(x):
        return _special(x, duration)
    if x == 0:
        return "0 s"
    if x < 0.1:
        return f"{number(x * 1000, 3)} ms"
    if x < 9.995:  # what rounds to 10.00 is shown as 10.0 s
        return f"{x:.2f} s"
    if x < 59.95:
        return f"{x:.1f} s"
    whole = round(x)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(x / 60)
    if minutes < 24 * 60:
        return f"{minutes // 60} h {minutes % 60:02d} min"
    hours = round(x / 3600)
    return f"{hours // 24} d {hours % 24:02d} h"


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(nbytes) -> str:
    """A byte count in binary units to 3 significant digits: 1536 -> "1.50 KiB", 2**30 -> "1.00 GiB"."""
    x = _finite(nbytes)
    if x is None or x < 0 or math.isinf(x):
        return _special(x, size)
    unit = 0
    while x >= 1023.5 and unit < len(_UNITS) - 1:  # 1023.5 B would read "1,024 B": one unit up instead
        x /= 1024
        unit += 1
    if unit == 0:
        return f"{round(x)} B"
    return f"{number(x, 3)} {_UNITS[unit]}"
