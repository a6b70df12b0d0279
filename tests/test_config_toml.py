"""`to_toml` writes a run config that loads back as the same config; `zaya train --print-config` prints it."""

import math
from pathlib import Path

import pytest
import tomllib

from zaya.config import Phase, Source, load_config, phase_name_problem
from zaya.config_toml import to_toml, toml_value
from zaya.errors import ZayaError

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))


def _reload(config, tmp_path):
    path = tmp_path / "printed.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    return load_config(path)


def _write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_round_trips(path, tmp_path):
    config = load_config(path)
    assert _reload(config, tmp_path).to_dict() == config.to_dict()


def test_phases_sources_and_model_overrides_round_trip(tmp_path):
    path = _write(tmp_path, """
[model]
preset = "micro"
temp_init = 1.0
rope_theta = 50000.0
skip_route = "identity"
fp32_logits = false

[data]
path = "data/default"

[optim]
adamw_lr = 0.0005
adamw_betas = [0.8, 0.99]

[schedule]
total_steps = 40
warmup_steps = 3

[train]
max_steps = 30

[[phases]]
name = "short"
tokens = 1_000
seq_len = 64
[[phases.sources]]
path = "data/a"
weight = 0.25
[[phases.sources]]
path = "data/b"
weight = 0.75

[[phases]]
name = "long"
rope_theta = 1e6
cp = 2
""")
    config = load_config(path)
    again = _reload(config, tmp_path)
    assert again.to_dict() == config.to_dict()
    assert again.model.overrides == {"temp_init": 1.0, "rope_theta": 50000.0, "skip_route": "identity",
                                     "fp32_logits": False}
    assert again.schedule.total_steps == 40 and again.optim.adamw_lr == 0.0005
    assert [s.path for s in again.phases[0].sources] == ["data/a", "data/b"] and again.phases[1].sources == []


@pytest.mark.parametrize("text", [
    'say "hi"', "back\\slash", "C:\\runs\\new", "line\nbreak", "tab\tand\rreturn", "\x00\x1f\x7f bell \x07",
    "ünïcødé 数据 🚀", "'single' and \"\"\"triple\"\"\"", "# not a comment", "a = 1", "[not.a.table]", "",
])
def test_special_strings_round_trip(text, tmp_path):
    path = _write(tmp_path, "[data]\npath = \"x\"\n")
    config = load_config(path)
    name = text.replace("\x00", "")  # no path can hold a NUL
    config.data.path = "data/" + name  # data.path may not be empty
    config.logging.wandb_name = text
    config.checkpoint.dir = name
    # a phase's name names a file of the run directory: printable, no separator
    phase = text if phase_name_problem(text) is None else "special"
    config.phases = [Phase(name=phase, sources=[Source(name, 0.5), Source("data/" + name)])]
    assert _reload(config, tmp_path).to_dict() == config.to_dict()


def test_values_are_valid_toml():
    for value in [0.1, 1e-8, 1e300, 5e-324, -0.0, 1.0, 3, -1, 2**62, True, False, [], (0.9, 0.95), {"a b": 1},
                  [{"path": "p", "weight": 0.5}]]:
        parsed = tomllib.loads(f"v = {toml_value(value)}")["v"]
        expected = list(value) if isinstance(value, tuple) else value
        assert parsed == expected and type(parsed) is type(expected), value
    assert math.isinf(tomllib.loads(f"v = {toml_value(-math.inf)}")["v"])
    assert math.isnan(tomllib.loads(f"v = {toml_value(math.nan)}")["v"])


def test_total_steps_filled_in_from_max_steps_follows_a_new_max_steps(tmp_path):
    config = load_config(CONFIGS[0])
    printed = _write(tmp_path, to_toml(config), "printed.toml")
    assert load_config(printed, ["train.max_steps=1000"]).schedule.total_steps == 1000
    assert load_config(CONFIGS[0], ["train.max_steps=1000"]).to_dict() == load_config(
        printed, ["train.max_steps=1000"]).to_dict()


def test_values_toml_cannot_hold_are_refused():
    with pytest.raises(ZayaError, match="null"):
        toml_value([1, None], "optim.x")
    with pytest.raises(ZayaError, match="surrogate"):
        toml_value("\ud800", "data.path")
    with pytest.raises(ZayaError, match="cannot write"):
        toml_value(object(), "data.path")


def test_cli_print_config_applies_set_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from zaya.cli import main

    monkeypatch.chdir(tmp_path)  # the default run directory would be runs/tiny here
    tiny = Path(__file__).parents[1] / "configs" / "tiny.toml"
    # tiny's 20 warmup steps do not fit in 7 steps: the loader refuses that, so the warmup shrinks too
    code = main(["train", str(tiny), "--print-config", "--set", "train.max_steps=7",
                 "--set", "schedule.warmup_steps=2", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0
    printed = _write(tmp_path, out, "printed.toml")
    config = load_config(printed)
    assert config.train.max_steps == 7 and config.schedule.total_steps == 7 and config.schedule.warmup_steps == 2
    expected = load_config(tiny, ["train.max_steps=7", "schedule.warmup_steps=2"])
    assert config.to_dict() == expected.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["printed.toml"]


def test_cli_print_config_reports_a_bad_key_in_one_line(tmp_path, monkeypatch, capsys):
    from zaya.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = Path(__file__).parents[1] / "configs" / "tiny.toml"
    assert main(["train", str(tiny), "--print-config", "--set", "train.nope=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown key 'train.nope'" in captured.err
    assert list(tmp_path.iterdir()) == []
