"""A run config written back as TOML: `to_toml(load_config(path))` loads as the same config.

The standard library reads TOML but does not write it, so this is a small writer for what a `RunConfig` holds:
tables, the arrays of tables `[[phases]]` and `[[phases.sources]]`, strings, integers, floats (written with
`repr`, which round-trips), booleans and arrays. The model's overrides go back as plain `[model]` keys beside
`preset`, as a config file has them. A value TOML cannot hold (an unset `None`) is left out, which loads as the
field's default; `schedule.total_steps`, when it is the `train.max_steps` that loading fills in, is written as
a comment so that the output, loaded with a new `--set train.max_steps`, follows it as the original would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

from zaya.errors import ZayaError

if TYPE_CHECKING:
    from zaya.config import RunConfig

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def to_toml(config: RunConfig) -> str:
    """The config as a TOML document that `zaya.config.load_config` reads back into an equal config."""
    data = config.to_dict()
    model = data.pop("model")
    lines: list[str] = ["[model]", f"preset = {toml_value(model['preset'])}"]
    lines += _table_body(model["overrides"], "model")
    phases = data.pop("phases")
    schedule = data["schedule"]
    for name, section in data.items():
        lines.append("")
        lines.append(f"[{_key(name)}]")
        if name == "schedule" and schedule["total_steps"] == data["train"]["max_steps"]:
            section = {k: v for k, v in section.items() if k != "total_steps"}
            lines.append(f"# total_steps = {schedule['total_steps']}  (train.max_steps, filled in on loading)")
        lines += _table_body(section, name)
    for phase in phases:
        sources = phase.pop("sources")
        lines += ["", "[[phases]]"]
        lines += _table_body(phase, "phases")
        for source in sources:
            lines.append("[[phases.sources]]")
            lines += _table_body(source, "phases.sources")
    return "\n".join(lines) + "\n"


def toml_value(value: Any, key: str = "value") -> str:
    """One value as TOML: a string, integer, float, boolean, array or inline table (`key` names it in errors)."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value, key)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, f"{key}.{i}") for i, v in enumerate(value)) + "]"
    if isinstance(value, dict):
        items = [f"{_key(k)} = {toml_value(v, f'{key}.{k}')}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return toml_value(dataclasses.asdict(value), key)
    if value is None:
        raise ZayaError(f"key '{key}': TOML has no null, so an unset value inside an array cannot be written")
    raise ZayaError(f"key '{key}': cannot write a {type(value).__name__} as TOML ({value!r})")


def _table_body(table: dict[str, Any], prefix: str) -> list[str]:
    # scalars and arrays as `key = value`; a nested table (a dict no config holds today) as an inline table,
    # which keeps every key inside its own section whatever follows it
    return [f"{_key(k)} = {toml_value(v, f'{prefix}.{k}')}" for k, v in table.items() if v is not None]


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _string(name, name)


def _string(text: str, key: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        elif 0xD800 <= ord(char) <= 0xDFFF:
            raise ZayaError(f"key '{key}': the string {text!r} holds a lone surrogate, which TOML cannot encode")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
