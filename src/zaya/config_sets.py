"""Where a run config's values came from, and the `--set key.path=value` items of the command line that change
them: each item is checked against the config's own classes (a key that exists, or the nearest one suggested;
one value, not a whole table; an entry of an array of tables the file has) and applied to the file's table
before the config is built from it, and the key it set is remembered (`Origin`), so that a wrong value given by
`--set` is blamed on the `--set`, not on the file."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import ModelSection
from zaya.reading import MAX_DEPTH, check_depth
from zaya.schema import shown


@dataclass(frozen=True)
class Origin:
    """Where a loaded config's values came from, for its messages: the file, and the `--set` item that gave each
    key set on the command line (a wrong value given by `--set` is not the file's to fix)."""

    path: str
    sets: dict[str, str] = field(default_factory=dict)  # dotted key -> the --set item that set it

    def of(self, *keys: str) -> str:
        """What a message about `keys` names: `--set ITEM` for the first of them (or a value inside it) that a
        `--set` gave, else the file."""
        for key in keys:
            for given, item in self.sets.items():
                if key == given or key.startswith(given + "."):
                    return f"--set {item}"
        return self.path

    def __str__(self) -> str:
        return self.path


def apply_override(raw: dict, item: str, path: Path, root: type, moved: dict[str, str]) -> str:
    """Apply one `--set` item to the file's table `raw`, whose values make a `root` (the run config); returns the
    key it sets. `moved`: keys that moved, and where to."""
    if "\n" in item or "\r" in item:
        # parsed as the TOML `v = VALUE`, a line break would end the value and drop (or add) what follows
        raise ZayaError(f"--set {shown(item)}: a value may not hold a line break")
    if "=" not in item:
        raise ZayaError(f"--set {shown(item)}: expected key.path=value")
    key, text = item.split("=", 1)
    key = key.strip()
    _check_override_key(key, item, root, moved)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ZayaError(f"--set {key}: not a value zaya reads ({str(exc).split(';')[0][:120]})") from None
    except RecursionError:
        raise ZayaError(f"--set {key}: the value is nested more than {MAX_DEPTH} deep") from None
    check_depth(value, f"--set {key}", MAX_DEPTH)
    parts = key.split(".")
    node: Any = raw
    hint: Any = root
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        hint = _field_hint(hint, part)
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                table = ".".join(parts[:i])
                raise ZayaError(f"--set {key}: '{table}' of {path} has no entry {part} (it has {len(node)}: "
                                f"0..{len(node) - 1})" if node else f"--set {key}: '{table}' of {path} is empty")
            node = node[int(part)]
        elif typing.get_origin(hint) is list and part not in node:
            # an array of tables: --set changes an entry the file has, it does not make one
            header = ".".join(p for p in parts[: i + 1] if not p.isdigit())
            raise ZayaError(f"--set {key}: {path} has no [[{header}]]; add the entries to the file, then --set "
                            "their keys")
        else:
            node = node.setdefault(part, {})
        if typing.get_origin(hint) is list and not isinstance(node, list):
            raise ZayaError(f"--set {key}: '{where}' of {path} is not an array of tables")
        if not isinstance(node, (dict, list)):
            raise ZayaError(f"--set {key}: '{where}' is not a table")
    if isinstance(node, list):
        raise ZayaError(f"--set {key}: cannot replace a list entry")
    node[parts[-1]] = value
    return key


def _field_hint(hint: Any, part: str) -> Any:
    """The type of `part` inside a value of type `hint` (an entry of a list, a field of a section); Any once inside
    a free-form table."""
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0]
    if dataclasses.is_dataclass(hint) and hint is not ModelSection:
        return typing.get_type_hints(hint).get(part, Any)
    return Any


def _check_override_key(key: str, item: str, root: type, moved: dict[str, str]) -> None:
    """`--set` names one value of the run config: a key that exists (else the nearest one is suggested), and not a
    whole table."""
    parts = key.split(".")
    hint: Any = root
    for i, part in enumerate(parts):
        if typing.get_origin(hint) is list:  # an entry of [[phases]]: its index is checked against the file
            (hint,) = typing.get_args(hint)
            continue
        if hint is ModelSection:  # [model] takes the preset and any model field
            names = {"preset": str, **{f.name: typing.Any for f in dataclasses.fields(ZayaConfig)}}
        elif dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            names = {f.name: hints[f.name] for f in dataclasses.fields(hint)
                     if f.name not in ("source", "given")}
        else:
            return  # inside a free-form table
        where = ".".join(parts[: i + 1])
        if part not in names:
            if where in moved:
                raise ZayaError(f"--set {item}: key '{where}' moved to '{moved[where]}'")
            raise ZayaError(f"--set {item}: unknown key '{where}'{nearest(part, names, '.'.join(parts[:i]))}")
        hint = names[part]
    if dataclasses.is_dataclass(hint):
        first = next(f.name for f in dataclasses.fields(hint))
        raise ZayaError(f"--set {item}: '{key}' is a table; set one of its keys, e.g. --set {key}.{first}=...")


def nearest(name: str, names, prefix: str) -> str:
    """' (did you mean 'PREFIX.X'?)' for the known name nearest `name`, or the list of known names."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    dotted = f"{prefix}." if prefix else ""
    if close:
        return f" (did you mean '{dotted}{close[0]}'?)"
    return f" (known: {', '.join(sorted(names))})"


def shown_key(key: str) -> str:
    # a quoted TOML key may hold anything, a line break or a megabyte among it: the message stays one short line
    return key if key.isprintable() and len(key) <= 200 else repr(key)[1:-1][:200]
