"""docs/configuration.md is `zaya.config_docs.render()`: every config key, each with a meaning, each loadable."""

import dataclasses
import re
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from zaya import config_docs
from zaya.config import RunConfig, load_config
from zaya.config_docs import ALLOWED_VALUES, REGENERATE, field_comments, render, sections
from zaya.config_toml import toml_value
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import get_preset

DOCS = Path(__file__).parents[1] / "docs" / "configuration.md"
BASE = """
[model]
preset = "tiny"

[data]
path = "data/base"

[[phases]]
name = "main"
[[phases.sources]]
path = "data/base"
"""


def _documented(markdown: str) -> dict[str, tuple[str, str, str]]:
    """`key.path` (`phases.N.sources.N.weight`) -> (type, default, meaning) for every row of a key table."""
    keys, prefix, table = {}, None, None
    for line in markdown.splitlines():
        heading = re.fullmatch(r"## `(\[\[?)([\w.]+)\]\]?`", line)
        if heading:
            parts = heading.group(2).split(".")
            prefix = "".join(f"{p}.N." for p in parts) if heading.group(1) == "[[" else f"{parts[0]}."
        if not line.startswith("|"):
            table = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if table is None:  # a table's first row names its columns
            table = cells
        elif table == ["key", "type", "default", "meaning"] and not cells[0].startswith("---"):
            key = prefix + cells[0].strip("`")
            assert key not in keys, f"{key} documented twice"
            keys[key] = (cells[1], cells[2], cells[3])
    return keys


def _expected_keys() -> set[str]:
    keys = {f"model.{f.name}" for f in dataclasses.fields(ZayaConfig)} | {"model.preset"}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            keys.add(prefix + f.name)
            if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
                walk(typing.get_args(hint)[0], f"{prefix}{f.name}.N.")

    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name in ("model", "source", "given"):  # not keys of a file: where it came from, what it gave
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            walk(hints[f.name], f"{f.name}.")
        else:
            walk(typing.get_args(hints[f.name])[0], f"{f.name}.N.")
    return keys


def test_the_committed_reference_is_current():
    assert DOCS.read_text(encoding="utf-8") == render(), (
        f"docs/configuration.md is out of date: regenerate it with `{REGENERATE}`")


def test_sections_come_in_the_order_of_a_config_file():
    assert [s.header for s in sections()] == [
        "[model]", "[data]", "[train]", "[optim]", "[schedule]", "[balance]", "[checkpoint]", "[logging]",
        "[parallel]", "[[phases]]", "[[phases.sources]]"]


def test_every_field_of_every_section_is_documented_with_a_meaning():
    documented = _documented(DOCS.read_text(encoding="utf-8"))
    assert set(documented) == _expected_keys()
    empty = [key for key, (_, _, meaning) in documented.items() if not meaning]
    assert not empty, f"keys without a meaning (add a comment to the field): {empty}"
    for section in sections():
        for key in section.keys:
            assert documented[key.key] == (key.type, key.default.replace("|", "\\|"), key.meaning.replace("|", "\\|"))


def _value_for(key: str, default: str) -> str:
    """The TOML text of `key`'s documented default, or of a valid value where the default is not a literal."""
    if default.startswith("`"):
        return default.strip("`")
    if default == "from the preset":
        return toml_value(getattr(get_preset("tiny"), key.split(".")[-1]))
    return {"optim.adamw_lr": "0.002", "phases.0.sources.0.path": '"data/other"',
            "phases.0.isolate_documents": "true", "model.sliding_window": "64",
            "model.layer_types": '["hybrid", "hybrid", "hybrid", "hybrid"]'}[key]


def _lookup(config, key: str):
    if key.startswith("model.") and key != "model.preset":
        return getattr(config.model_config(), key.split(".", 1)[1])
    node = config
    for part in key.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def test_every_documented_key_loads_with_its_default(tmp_path):
    path = tmp_path / "base.toml"
    path.write_text(BASE, encoding="utf-8")
    for key, (_, default, _) in _documented(DOCS.read_text(encoding="utf-8")).items():
        key = key.replace(".N.", ".0.")
        text = _value_for(key, default)
        config = load_config(path, [f"{key}={text}"])
        value = _lookup(config, key)
        expected = tomllib.loads(f"v = {text}")["v"]
        if key == "phases.0.sources":
            assert value == expected == [], key
        else:
            assert (list(value) if isinstance(value, tuple) else value) == expected, key


@pytest.mark.parametrize("key", sorted({*ALLOWED_VALUES, "model.skip_route"}))
def test_allowed_values_are_the_ones_the_loader_accepts(key, tmp_path):
    path = tmp_path / "base.toml"
    path.write_text(BASE, encoding="utf-8")
    documented = _documented(render())[key][2]
    allowed = re.search(r"One of: (.*)\.$", documented).group(1)
    values = [tomllib.loads(f"v = {v.strip('`')}")["v"] for v in allowed.split(", ")]
    assert values == list(ALLOWED_VALUES.get(key, ("zero", "identity")))
    for value in values:
        config = load_config(path, [f"{key}={toml_value(value)}"])
        assert _lookup(config, key) == value
    with pytest.raises(ZayaError, match=key.split(".")[-1]):
        load_config(path, [f'{key}="not-a-value"'])


def test_field_comments_join_the_lines_above_and_the_trailing_comment():
    @dataclass
    class Example:
        # the first line
        # and the second
        both: int = 1  # trailing
        trailing: float = 2.0  # only this

        # separated by a blank line, so not the comment of `none`

        none: str = ""
        listed: list[int] = field(  # a field over
            default_factory=list,  # two lines
        )
        pragma: int = 0  # fmt: skip

    assert field_comments(Example) == {
        "both": "the first line and the second; trailing", "trailing": "only this", "none": "",
        "listed": "a field over two lines", "pragma": ""}


def test_write_is_atomic_and_keeps_the_mode(tmp_path):
    target = tmp_path / "configuration.md"
    target.write_text("old", encoding="utf-8")
    target.chmod(0o664)
    assert config_docs.main(["--write", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render()
    assert target.stat().st_mode & 0o777 == 0o664
    assert [p.name for p in tmp_path.iterdir()] == ["configuration.md"]
    assert config_docs.main(["--write", str(tmp_path / "missing" / "configuration.md")]) == 2


def test_python_m_prints_the_reference():
    result = subprocess.run([sys.executable, "-m", "zaya.config_docs"], capture_output=True, text=True, timeout=300,
                            check=True)
    assert result.stdout == render()


def _numbers(cls, prefix: str):
    """(range key, hint, default) of every int and float field under dataclass `cls` (N: an entry of a list)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(hint):
            yield from _numbers(hint, key + ".")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            yield from _numbers(typing.get_args(hint)[0], key + ".N.")
        elif typing.get_origin(hint) is tuple:
            (item,) = set(typing.get_args(hint))
            for value in default or ():
                yield key + ".N", item, value
        elif hint in (int, float):
            yield key, hint, default


def test_every_number_has_a_range_that_holds_its_default_and_is_documented():
    from zaya.config import RANGES
    from zaya.model.config import FLOAT_RANGES, SIZE_LIMITS

    numbers = [n for n in _numbers(RunConfig, "") if not n[0].startswith(("model.", "source"))]
    assert {key for key, _, _ in numbers} == set(RANGES)  # every number has a range, every range a number
    for key, _, default in numbers:
        assert default is None or RANGES[key].holds(default), (key, default)
    model = {f.name for f in dataclasses.fields(ZayaConfig) if f.type in ("int", "float", "int | None", int, float)}
    assert model == {*SIZE_LIMITS, *FLOAT_RANGES, "pad_token_id", "bos_token_id", "eos_token_id"}
    documented = dict(config_docs.range_rows())
    assert set(documented) == set(RANGES) | {f"model.{name}" for name in model}
    table = DOCS.read_text(encoding="utf-8").split("## Ranges", 1)[1]
    for key, text in documented.items():
        assert f"| `{key}` | {text} |" in table, key


def test_the_shipped_configs_are_inside_every_range():
    # ZAYA1's own config, the largest, and the small ones: no real run is refused by a range
    for path in sorted((Path(__file__).parents[1] / "configs").glob("*.toml")):
        load_config(path)
