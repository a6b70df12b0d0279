"""`parallel.layout = "auto"` on gloo ranks with a table of this machine: the layout the run chooses is the one
`zaya plan --search` ranks first for the same config and world, it trains exactly as that layout set by hand does,
a resume on as many ranks keeps it, and one on another world size plans anew and trains as the hand-set resume;
where the device has no figures to plan with, the config's own layout trains, said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ranks import zaya_train
from runs import write_config, zaya_command
from zaya.config import load_config
from zaya.plan.table import EfficiencyTable, GemmRecord, default_table_path
from zaya.run_dir import CONFIG_HISTORY_FILE
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def _table() -> EfficiencyTable:
    # a table as `zaya shapes` writes it (its figures made up: what is tested is that the run and `zaya plan` read
    # the same one and choose alike)
    return EfficiencyTable(
        device="cpu", device_label="Test CPU", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=5e-6, records=[GemmRecord("dense", 1024, 1024, 1024, 1, "fp32", 0.025, 2 * 1024**3)],
        preset="micro", measured_at="2025-01-01T00:00:00+00:00", torch_version="x",
        peaks={"fp32": 1e11, "bf16": 1e9}, memory_bytes=24 * 10**9, tokens=[1024])


def _config(tmp_path: Path, dataset: Path, layout: str) -> Path:
    config = write_config(tmp_path / f"{layout}.toml", dataset,
                          train={"max_steps": 4, "global_batch_size": 8, "eval_every": 0},
                          schedule={"total_steps": 8}, checkpoint={"every": 2, "keep": 5},
                          parallel={"layout": layout})
    text = config.read_text(encoding="utf-8").replace("micro_batch_size = 4\n", "")  # the search's to choose
    config.write_text(text, encoding="utf-8")
    return config


def _train(config: Path, run_dir: Path, ranks: int, env: dict, *sets: str) -> None:
    for rank, (code, _, err) in enumerate(zaya_train(config, run_dir, ranks, *sets, env=env)):
        assert code == 0, f"rank {rank}: {err[-4000:]}"


def _searched(config: Path, ranks: int, table: Path) -> list[str]:
    code, out, err = zaya_command(["plan", config, "--gpus", ranks, "--gpus-per-node", ranks, "--device", "local",
                                   "--table", table, "--search", "--json"])
    assert code == 0, err
    return next(c for c in json.loads(out)["search"] if c["reason"] == "")["settings"]


def _choices(run_dir: Path) -> list[dict]:
    lines = (run_dir / CONFIG_HISTORY_FILE).read_text(encoding="utf-8").splitlines()
    return [entry["layout"] for entry in map(json.loads, lines) if "layout" in entry]


def _losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)}


@pytest.mark.slow
def test_auto_trains_as_the_layout_it_chose_set_by_hand_and_plans_anew_on_another_world(dataset, tmp_path):
    cache = tmp_path / "cache"
    table = _table().save(default_table_path("fp32", cache))
    env = {"ZAYA_CACHE": str(cache)}
    auto, own = _config(tmp_path, dataset, "auto"), _config(tmp_path, dataset, "config")
    chosen, by_hand = tmp_path / "chosen", tmp_path / "by-hand"

    _train(auto, chosen, 4, env)
    (first,) = _choices(chosen)
    assert first["world_size"] == 4 and first["device"] == "local"
    assert first["settings"] == _searched(auto, 4, table)  # what `zaya plan --search` ranks first
    log = (chosen / "train.log").read_text(encoding="utf-8")
    assert "layout auto for 4 x local (4 per node)" in log and "pin it with --set" in log
    _train(own, by_hand, 4, env, *first["settings"])
    assert _losses(chosen) == _losses(by_hand) and len(_losses(chosen)) == 4

    # as many ranks again: the layout is kept, not searched for
    _train(auto, chosen, 4, env, "train.max_steps=5")
    assert len(_choices(chosen)) == 1
    assert "layout auto: kept the layout the run chose for its 4 rank(s)" in (chosen / "train.log").read_text()

    # 2 ranks: planned anew, said, recorded; the run goes on as the hand-set run resumed on 2 ranks with it
    _train(own, by_hand, 4, env, *first["settings"], "train.max_steps=5")
    _train(auto, chosen, 2, env, "train.max_steps=7")
    second = _choices(chosen)[-1]
    assert second["world_size"] == 2 and second["settings"] == _searched(auto, 2, table)
    log = (chosen / "train.log").read_text(encoding="utf-8")
    assert "re-planned: the checkpoint's run had 4 rank(s)" in log
    _train(own, by_hand, 2, env, *second["settings"], "train.max_steps=7")
    ours, theirs = _losses(chosen), _losses(by_hand)
    assert ours == theirs and sorted(ours) == list(range(1, 8))


def test_without_figures_to_plan_with_the_config_s_own_layout_trains(dataset, tmp_path):
    config = _config(tmp_path, dataset, "auto")
    run_dir = tmp_path / "run"
    build_trainer(load_config(config, ["train.max_steps=1"]), run_dir, environ={"ZAYA_CACHE": str(tmp_path)}).run()
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    line = next(line for line in log.splitlines() if "layout auto:" in line)
    assert "no step-time prediction" in line and "training in the config's own layout" in line
    assert "finished at step 1" in log and not (run_dir / CONFIG_HISTORY_FILE).exists()


def test_one_process_says_records_and_keeps_its_choice_and_print_config_shows_it(dataset, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _table().save(default_table_path("fp32", cache))
    config = _config(tmp_path, dataset, "auto")
    run_dir = tmp_path / "run"
    build_trainer(load_config(config, ["train.max_steps=1"]), run_dir, environ={"ZAYA_CACHE": str(cache)}).run()
    (choice,) = _choices(run_dir)
    assert choice["world_size"] == 1 and choice["predicted"]["step_time_s"] > 0
    line = next(line for line in (run_dir / "train.log").read_text().splitlines() if "layout auto for" in line)
    assert line.endswith(" ".join(f"--set {s}" for s in choice["settings"]))
    assert len(list((cache / "layouts").iterdir())) == 1  # a relaunch reads it
    # --print-config plans as a fresh launch here would, and writes nothing; its TOML pins the choice
    monkeypatch.setenv("ZAYA_CACHE", str(cache))
    before = sorted(p for p in tmp_path.rglob("*"))
    code, out, err = zaya_command(["train", config, "--print-config"])
    assert code == 0, err
    assert sorted(p for p in tmp_path.rglob("*")) == before
    comment = out.splitlines()[1]
    assert comment.startswith("# layout auto for 1 x local") and "as a fresh launch of 1 rank(s) here" in comment
    printed = tmp_path / "printed.toml"
    printed.write_text(out, encoding="utf-8")
    pinned = load_config(printed)
    assert pinned.parallel.layout == "auto" and {f"{k}={v}" for k, v in _values(pinned).items()} >= \
        set(choice["settings"])


def _values(config) -> dict:
    from zaya.config import LAYOUT_KEYS

    return {key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in LAYOUT_KEYS}
