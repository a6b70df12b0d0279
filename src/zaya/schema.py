"""Typed fields of a JSON or TOML document that zaya did not just make: a field of the wrong type, out of range or
missing is one `ZayaError` naming the file and the key, instead of a `KeyError`, `TypeError` or a wrong value
deep inside whatever uses it.

    doc = Fields(reading.read_json_object(path), path)
    step = doc.int("step", lo=0)
    files = doc.obj("files")                     # a nested object, its keys named "files.NAME" in messages
    name = doc.str("tokenizer", default=None)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zaya.errors import ZayaError

_MISSING: Any = object()
INT_BOUND = 2**63  # an integer field outside +-2**63 is refused: torch, numpy and the OS take int64 at most


class Fields:
    """The fields of one JSON object read from `source`; `where` is the dotted key of the object in its file."""

    def __init__(self, data: Any, source: Path | str, where: str = ""):
        if not isinstance(data, dict):
            at = f" at '{where}'" if where else ""
            raise ZayaError(f"{source}: expected a JSON object{at}, got {type_name(data)}")
        self.data, self.source, self.where = data, source, where

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def _absent(self, name: str, default: Any) -> Any:
        """What an absent field gives: its default, or one line if it has none."""
        if default is _MISSING:
            raise ZayaError(f"{self.source}: missing field '{self.key(name)}'")
        return default

    def _items(self, name: str, items, of: type | tuple[type, ...]) -> None:
        for key, item in items:
            if not is_a(item, of):
                raise ZayaError(f"{self.source}: field '{self.key(name)}.{key}' must be {_names(of)}, got "
                                f"{shown(item)}")

    def _wrong(self, name: str, expected: str, value: Any) -> ZayaError:
        return ZayaError(f"{self.source}: field '{self.key(name)}' must be {expected}, got {shown(value)}")

    def int(self, name: str, default: Any = _MISSING, *, lo: int | None = None, hi: int | None = None) -> Any:
        """An integer (not a bool) in [lo, hi] (within +-2**63 in any case)."""
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        low = -INT_BOUND if lo is None else lo
        high = INT_BOUND - 1 if hi is None else hi
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            if lo is not None and hi is not None:
                expected = f"an integer in {lo:,}..{hi:,}"
            elif lo is not None:
                expected = f"an integer >= {lo:,} (below 2**63)"
            elif hi is not None:
                expected = f"an integer <= {hi:,}"
            else:
                expected = "an integer within +-2**63"
            raise self._wrong(name, expected, value)
        return value

    def float(self, name: str, default: Any = _MISSING, *, lo: float | None = None, hi: float | None = None) -> Any:
        """A finite number (an integer is taken as one) in [lo, hi]."""
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            lo is None or value >= lo) and (hi is None or value <= hi)
        if not ok:
            bounds = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (
                f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else ""))
            raise self._wrong(name, f"a finite number{bounds}", value)
        return float(value)

    def str(self, name: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None,
            max_len: int = 1 << 16) -> Any:
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        if not isinstance(value, str) or len(value) > max_len:
            raise self._wrong(name, f"a string of at most {max_len:,} characters", value)
        if choices is not None and value not in choices:
            raise self._wrong(name, "one of " + ", ".join(repr(c) for c in choices), value)
        return value

    def bool(self, name: str, default: Any = _MISSING) -> Any:
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false", value)
        return value

    def list(self, name: str, default: Any = _MISSING, *, of: type | tuple[type, ...] | None = None,
             max_len: int | None = None) -> Any:
        """A list, each item of type `of` (ints exclude bools) if given, at most `max_len` long."""
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        if not isinstance(value, list) or (max_len is not None and len(value) > max_len):
            limit = f" of at most {max_len:,} items" if max_len is not None else ""
            raise self._wrong(name, f"a list{limit}", value)
        if of is not None:
            self._items(name, enumerate(value), of)
        return value

    def obj(self, name: str, default: Any = _MISSING) -> Any:
        """A nested object, as `Fields` (`default` is returned as it is when the field is absent)."""
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        return Fields(value, self.source, self.key(name))

    def dict(self, name: str, default: Any = _MISSING, *, of: type | tuple[type, ...] | None = None) -> Any:
        """A nested object as a plain dict, each value of type `of` if given."""
        if name not in self.data:
            return self._absent(name, default)
        value = self.data[name]
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        if of is not None:
            self._items(name, value.items(), of)
        return value


def is_a(value: Any, kinds: type | tuple[type, ...]) -> bool:
    """isinstance, except that a bool is not an int and a float must be finite."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and int in kinds:
        return -INT_BOUND <= value < INT_BOUND
    if isinstance(value, float):
        return float in kinds and math.isfinite(value)
    return isinstance(value, kinds)


def _names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", dict: "an object",
             list: "a list", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def shown(value: Any, limit: int = 60) -> str:
    """A value for a message, cut to `limit` characters (a field may hold megabytes)."""
    if isinstance(value, (dict, list)):
        return type_name(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
