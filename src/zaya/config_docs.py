"""The configuration reference, docs/configuration.md, generated from the config dataclasses.

Every key's type and default come from the dataclass field, its meaning from the field's comment in the source
(the comment lines just above it and its trailing comment), so the reference cannot drift from the code; a test
compares the committed file with `render()`. After changing a config field or its comment, regenerate it:

    python -m zaya.config_docs --write           # rewrites docs/configuration.md atomically
    python -m zaya.config_docs > docs/configuration.md
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import sys
import tempfile
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from zaya.config import MOVED_KEYS, RANGES, RunConfig
from zaya.config_toml import toml_value
from zaya.errors import ZayaError
from zaya.model import presets as presets_module
from zaya.model.config import FLOAT_RANGES, SIZE_LIMITS, ZayaConfig
from zaya.model.presets import PRESETS, ModelSection, get_preset
from zaya.optim.config import ADJUST_LR_FNS, NS_BACKENDS, NS_DTYPE_NAMES
from zaya.optim.schedule import DECAY_SHAPES, SCHEDULES
from zaya.parallel.config import ACTIVATION_CHECKPOINTING, BACKENDS, CP_KERNELS, CP_SHARDINGS, LAYOUTS, SHARDINGS
from zaya.train.config import PRECISIONS, WANDB_MODES

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m zaya.config_docs --write"

# The values a string key accepts, where the code keeps them in a constant; the tests load every value and a
# wrong one through `load_config`, so an entry that drifts from the validation fails there. `balance.error`
# has no constant: its two values are checked inline by zaya.config._validate.
ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "model.preset": tuple(PRESETS),
    "train.precision": PRECISIONS,
    "train.activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "optim.ns_dtype": NS_DTYPE_NAMES,
    "optim.ns_backend": NS_BACKENDS,
    "optim.adjust_lr_fn": ADJUST_LR_FNS,
    "schedule.kind": SCHEDULES,
    "schedule.decay_shape": DECAY_SHAPES,
    "balance.error": ("linear", "sign"),
    "logging.wandb_mode": WANDB_MODES,
    "parallel.backend": BACKENDS,
    "parallel.cp_kernel": CP_KERNELS,
    "parallel.cp_sharding": CP_SHARDINGS,
    "parallel.sharding": SHARDINGS,
    "parallel.layout": LAYOUTS,
}

_PRAGMAS = ("noqa", "type:", "fmt:", "pragma")
_WIDTH = 115  # paragraphs are wrapped; table rows cannot be
_TABLE_HEADER = "| key | type | default | meaning |\n| --- | --- | --- | --- |"


@dataclasses.dataclass
class KeyDoc:
    """One documented key: its dotted path (`phases.N.sources.N.path` for arrays of tables), type, default."""

    key: str
    type: str
    default: str
    meaning: str


@dataclasses.dataclass
class SectionDoc:
    """One TOML section: its header (`[train]`, `[[phases]]`), its dataclass and its keys."""

    header: str
    cls: type
    keys: list[KeyDoc]


def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` mapped to its comment: the comment lines above it, then its trailing one."""
    source = textwrap.dedent(inspect.getsource(cls))
    classdef = ast.parse(source).body[0]
    lines = source.splitlines()
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether the comment is the whole line)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if text.startswith(_PRAGMAS):
            continue
        line, column = token.start
        comments[line] = (text, not lines[line - 1][:column].strip())
    result = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                    if n in comments and not comments[n][1]]
        parts = [" ".join(above), " ".join(trailing)]
        result[node.target.id] = "; ".join(p for p in parts if p)
    return result


def type_name(hint: Any) -> str:
    """A field's type in TOML's words: integer, float, string, boolean, array of 2 floats, ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "string"
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:
            return " or ".join(type_name(a) for a in options)
        return f"{type_name(options[0])} (optional)"
    if origin is tuple:
        names = {type_name(a) for a in args}
        return f"array of {len(args)} {names.pop()}s" if len(names) == 1 else "array"
    if origin is list:
        return "array of tables" if dataclasses.is_dataclass(args[0]) else f"array of {type_name(args[0])}s"
    return {int: "integer", float: "float", str: "string", bool: "boolean"}.get(hint, getattr(hint, "__name__", "?"))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _default_text(value: Any, missing: str) -> str:
    if value is dataclasses.MISSING:
        return missing
    if value is None:
        return "unset"
    return f"`{toml_value(value)}`"


def _allowed(key: str, hint: Any) -> tuple[str, ...]:
    if key in ALLOWED_VALUES:
        return ALLOWED_VALUES[key]
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return ()


def _keys(cls: type, prefix: str, missing: str) -> list[KeyDoc]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    docs = []
    for f in dataclasses.fields(cls):
        if cls is ModelSection and f.name == "overrides":  # its entries are the ZayaConfig keys
            continue
        key = f"{prefix}{f.name}"
        meaning = comments.get(f.name, "")
        allowed = _allowed(key.replace(".N.", "."), hints[f.name])
        if allowed:
            end = "" if not meaning or meaning.endswith(".") else "."
            meaning = f"{meaning}{end} One of: {', '.join(f'`{toml_value(v)}`' for v in allowed)}.".strip()
        docs.append(KeyDoc(key, type_name(hints[f.name]), _default_text(_default(f), missing), meaning))
    return docs


def sections() -> list[SectionDoc]:
    """The sections of a run config in file order, each with its keys (the model's: `preset`, then ZayaConfig's)."""
    result = []

    def add(name: str, prefix: str, cls: type, array: bool) -> None:
        if cls is ModelSection:
            keys = _keys(ModelSection, prefix, "required") + _keys(ZayaConfig, prefix, "from the preset")
        else:
            keys = _keys(cls, prefix, "required")
        result.append(SectionDoc(f"[[{name}]]" if array else f"[{name}]", cls, keys))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
                add(f"{name}.{f.name}", f"{prefix}{f.name}.N.", typing.get_args(hint)[0], True)

    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            add(f.name, f"{f.name}.", hint, False)
        elif typing.get_origin(hint) is list:
            # a key of an array of tables is addressed by its index: phases.0.sources.1.weight
            add(f.name, f"{f.name}.N.", typing.get_args(hint)[0], True)
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(keys: list[KeyDoc]) -> list[str]:
    rows = [_TABLE_HEADER]
    for k in keys:
        rows.append(f"| `{k.key.rsplit('.', 1)[-1]}` | {k.type} | {_cell(k.default)} | {_cell(k.meaning)} |")
    return rows


def _docstring(cls: type) -> str:
    # dataclasses give a class without a docstring its signature as __doc__: read the source's own docstring
    classdef = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    doc = ast.get_docstring(classdef) or ""
    return " ".join(doc.split())


def _preset_table() -> list[str]:
    configs = {name: get_preset(name).to_dict() for name in PRESETS}
    names = [f.name for f in dataclasses.fields(ZayaConfig) if any(f.name in p for p in PRESETS.values())]
    rows = ["| field | " + " | ".join(f"`{n}`" for n in PRESETS) + " |", "| --- |" + " --- |" * len(PRESETS)]
    for field_name in names:
        rows.append(f"| {field_name} | " + " | ".join(_preset_value(configs[n][field_name]) for n in PRESETS) + " |")
    return rows


def _preset_value(value: Any) -> str:
    """A preset's value in a table cell: unset for None, and a list that repeats a pattern (40 block types) as
    the pattern and its count."""
    if value is None:
        return "unset"
    if isinstance(value, list) and value:
        n = len(value)
        period = next(p for p in range(1, n + 1) if n % p == 0 and value == value[:p] * (n // p))
        if period < n:
            return f"{toml_value(value[:period])} × {n // period}"
    return toml_value(value)


_HEADER = f"""\
# Configuration reference

Generated from the config dataclasses and the comments on their fields: edit those, then run
`{REGENERATE}` (or `python -m zaya.config_docs > docs/configuration.md`);
a test fails when this file and the code disagree.

A run config is a TOML file that `zaya train CONFIG` reads with `zaya.config.load_config` into typed
dataclasses, one per section below. Every key is optional unless its default says "required" (and `data.path`
unless every phase names its sources); a missing key takes its default. An unknown key, a value of the wrong
type or out of range, or a preset that does not exist is an error naming the key and the file, or the `--set`
that gave the value (one line, exit code 2, nothing written); an integer is accepted where a float is expected.
The datasets are checked when training starts, not when the config is loaded, and with them what would
otherwise stop the run later: with `train.eval_every` set, each phase's val split must hold one global batch of
windows (`train.global_batch_size` x (`seq_len` + 1) tokens); and the plan's memory must fit the device's (on a
CPU: the host's available memory, shared by its ranks), or the line names the largest part and the smallest
`--set` that makes it fit (`zaya train --allow-over-memory` starts it anyway, and says so in train.log).

- `--set key.path=value` (repeatable) overrides a key before the defaults are filled in. The value is read as
  TOML (`--set optim.lr=3e-3`, `--set optim.adamw_betas=[0.9,0.99]`, `--set train.compile=true`) and taken as
  a plain string when it is not TOML (`--set data.path=data/web`); a value may not hold a line break. A key of
  `[[phases]]` or `[[phases.sources]]` is addressed by the entry's index: `--set phases.0.seq_len=2048`,
  `--set phases.1.sources.0.weight=0.5` (the entry must exist in the file).
- `schedule.total_steps` defaults to `train.max_steps`.
- `zaya train CONFIG --print-config [--set ...]` prints the resolved config (defaults and overrides applied) as
  TOML and exits without training or writing anything; the output loads back as the same config.
"""


_RANGES_TEXT = """\
Every number of a run config must be finite and in its range, or loading the config stops with one line naming
the key and the range: `1..n` for an integer, `[a, b]` for a number with both bounds (`(a, b]`: not `a`;
`[a, b)`: not `b`), and `0 or ...` where one value outside means "none" or "keep". The ranges lie far beyond any
real run (ZAYA1's config among them): a value outside one is a typo, a value in the wrong unit, or one that would
overflow what it reaches (a timer, an int64, the memory) or train on NaN. A timeout or time limit of one process
is at most a year (31,622,400 s), the time budget of a run ten; counts of tokens and samples stay below 2**62.
A sequence may not be longer than `model.max_position_embeddings`, the longest the model is meant for (raise it
for a long-context phase), in any phase: RoPE would compute the positions beyond it, but the model never
trained on them and its export says it is not meant for them."""


def range_rows() -> list[tuple[str, str]]:
    """(key, range) of every bounded number: the model's fields (`zaya.model.config`), then the run config's
    (`zaya.config.RANGES`)."""
    hints = typing.get_type_hints(ZayaConfig)
    rows = [(f"model.{name}", f"1..{limit:,}") for name, limit in SIZE_LIMITS.items()]
    rows += [(f"model.{name}", bounds.text(integer=hints[name] is int)) for name, bounds in FLOAT_RANGES.items()]
    rows += [(f"model.{name}", "0..vocab_size - 1") for name in ("pad_token_id", "bos_token_id", "eos_token_id")]
    for key, bounds in RANGES.items():
        rows.append((key, bounds.text(integer=_is_integer(key))))
    return rows


def _is_integer(key: str) -> bool:
    """Whether the run-config key `key` (N: an entry of a list) holds an integer."""
    hint: Any = RunConfig
    for part in key.split("."):
        if part == "N":
            hint = typing.get_args(hint)[0]
            continue
        hint = typing.get_type_hints(hint)[part]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint is int


def render() -> str:
    """The Markdown reference of every config key: one table per section, in the order of a config file."""
    out = [_HEADER.rstrip("\n")]
    if MOVED_KEYS:
        moved = ", ".join(f"`{old}` is now `{new}`" for old, new in MOVED_KEYS.items())
        out.append(f"- Keys that moved are refused with their new name: {moved}.")
    for section in sections():
        out += ["", f"## `{section.header}`", ""]
        doc = textwrap.fill(_docstring(section.cls), width=_WIDTH, break_on_hyphens=False, break_long_words=False)
        if section.cls is ModelSection:
            presets = ", ".join(f"`{n}`" for n in PRESETS)
            doc = (f"The model. `preset` names a shape (`zaya.model.presets.PRESETS`):\n{presets}.\n"
                   "Every other key of `[model]` replaces one field of `zaya.model.config.ZayaConfig`, e.g.\n"
                   "`temp_init = 0.0`. The default shown for a field is its dataclass default; the preset sets the\n"
                   "real value of the fields it names (the table of presets below), and a key in `[model]`\n"
                   "replaces that.")
        if doc:
            out += [doc, ""]
        if section.cls is ModelSection:
            out += _table(section.keys[:1])
            out += ["", "### Model fields", ""]
            out += _table(section.keys[1:])
            # the presets module's docstring after its title line says what each preset is
            about = " ".join(" ".join(inspect.getdoc(presets_module).split("\n\n")[1:]).split())
            about = textwrap.fill(about, width=_WIDTH, break_on_hyphens=False, break_long_words=False)
            out += ["", "### Presets", "", about, "", "The values each preset gives the fields that any preset sets:",
                    ""]
            out += _preset_table()
        else:
            out += _table(section.keys)
    out += ["", "## Ranges", "", _RANGES_TEXT, "", "| key | range |", "| --- | --- |"]
    out += [f"| `{key}` | {_cell(text)} |" for key, text in range_rows()]
    return "\n".join(out) + "\n"


def write(path: Path = DOCS_PATH) -> None:
    """Write `render()` to `path` atomically (a temporary file beside it, then renamed over it)."""
    if not path.parent.is_dir():
        raise ZayaError(f"{path.parent}: no such directory (run from a source checkout)")
    text = render()
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644  # mkstemp's file is private
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """`python -m zaya.config_docs [--write [PATH]]`: print the reference, or write it to docs/configuration.md."""
    parser = argparse.ArgumentParser(prog="python -m zaya.config_docs", description=main.__doc__)
    parser.add_argument("--write", nargs="?", const=DOCS_PATH, type=Path, default=None, metavar="PATH",
                        help=f"write the reference atomically (default: {DOCS_PATH.parent.name}/{DOCS_PATH.name})")
    args = parser.parse_args(argv)
    try:
        if args.write is None:
            sys.stdout.write(render())
        else:
            write(args.write)
    except ZayaError as exc:
        print(f"zaya: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
