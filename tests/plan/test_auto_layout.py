"""`parallel.layout = "auto"`: the layout chosen at launch is the one `zaya plan --search` ranks first, within the
keys the config gives; planned as a config like any other it predicts what the search did; nothing fitting is
one line naming the smallest shortfall; a choice is kept in the cache and in a checkpoint's record."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from zaya.cli import main
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.plan import auto
from zaya.plan.auto import Cluster, LayoutCache, apply_layout, choose, layout_values, recorded_values
from zaya.plan.devices import get_device
from zaya.plan.forecast import Forecast
from zaya.plan.planner import plan_run
from zaya.plan.search import NEAR, Constraints, search_layouts

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "zaya1-base.toml"
AUTO = ['parallel.layout="auto"']
OWN = ['parallel.layout="config"']


def _cluster(gpus: int, device: str = "mi300x", per_node: int = 8) -> Cluster:
    return Cluster(gpus, min(per_node, gpus), get_device(device))


@functools.cache
def _search(sets: tuple[str, ...], gpus: int, device: str = "mi300x"):
    """(config, run, cluster, the search within what the config gives), once per module: a search of ZAYA1-base
    on 64 GPUs takes seconds."""
    config, cluster = load_config(BASE, list(sets)), _cluster(gpus, device)
    run = config.resolve(gpus, "bf16")
    constraints = Constraints.of_config(config, run)
    return config, run, cluster, search_layouts(run, cluster.gpus_per_node, cluster.device, constraints=constraints)


def _choose(sets: tuple[str, ...], gpus: int):
    config, run, cluster, ranked = _search(sets, gpus)
    return choose(config, run, cluster, ranked=ranked)


@pytest.mark.parametrize("gpus,sets", [(64, ()), (32, ("phases.2.cp=2",)), (16, ("data.ramp_start=0",))],
                         ids=["64", "own-cp", "16-no-ramp"])
def test_auto_picks_the_first_of_the_search_and_plans_as_it_predicted(gpus, sets):
    config, run, cluster, ranked = _search((*AUTO, *sets), gpus)
    best = next(c for c in ranked if not c.reason)
    choice = choose(config, run, cluster, ranked=ranked)
    assert choice.values == layout_values(best, run)
    # the config it gives is an ordinary one: resolved, checked and planned, it predicts what the search did
    chosen = choice.config.resolve(gpus, "bf16")
    chosen.check_job()
    planned = plan_run(chosen, cluster.device, None, cluster.gpus_per_node)
    assert planned.hours == pytest.approx(best.hours, rel=1e-12)
    assert [p.cp for p in planned.phases] == list(best.phase_cp)
    assert [p.layout.dp_replicate for p in planned.phases] == [best.layout.dp_replicate] * len(planned.phases)
    assert "layout auto for" in choice.line and "pin it with --set" in choice.line
    # the `--set` line pins it: the config with those items, planned, is the same run
    pinned = load_config(BASE, [*sets, *choice.settings]).resolve(gpus, "bf16")
    assert plan_run(pinned, cluster.device, None, cluster.gpus_per_node).hours == pytest.approx(best.hours, rel=1e-12)


def test_context_parallelism_is_chosen_phase_by_phase():
    # 64 MI300X: the 4k phases fastest without cp, the 131k rows of fine-tuning do not fit without it
    _, run, _, ranked = _search(tuple(AUTO), 64)
    best = next(c for c in ranked if not c.reason)
    assert best.phase_cp[0] == 1 and best.phase_cp[-1] > 1
    assert f"phases.{len(run.phases) - 1}.cp={best.phase_cp[-1]}" in best.settings()


@pytest.mark.parametrize("cp,sets", [(2, ("phases=[]",)), (8, ())], ids=["cp2-4k", "cp8-phases"])
def test_keys_the_config_gives_are_constraints_the_search_keeps(cp, sets):
    sets = (*AUTO, *sets, f"parallel.cp={cp}", "parallel.ep=4", 'train.activation_checkpointing="moe"')
    config, run, cluster, ranked = _search(sets, 64)
    assert any(not c.reason for c in ranked) and all(set(c.phase_cp) == {cp} for c in ranked)
    assert all(c.layout.ep == 4 and c.layout.activation_checkpointing == "moe" for c in ranked)
    choice = choose(config, run, cluster, ranked=ranked)
    assert not any(s.startswith(("parallel.cp=", "parallel.ep=", "train.activation_checkpointing="))
                   for s in choice.settings)  # what the config gives, it keeps: nothing to pin
    assert choice.config.parallel.cp == cp and choice.config.parallel.ep == 4
    assert {phase.cp for phase in choice.config.resolve(64, "bf16").phases} == {cp}
    # a phase's own cp is kept too, the others are searched
    ranked = _search((*AUTO, "phases.3.cp=8"), 16)[3]
    assert all(c.phase_cp[3] == 8 for c in ranked)
    assert len({c.phase_cp[0] for c in ranked}) > 1


def test_without_auto_the_search_keeps_only_the_phases_own_cp():
    ranked = _search((*OWN, "parallel.ep=4", "phases.3.cp=8"), 16)[3]
    assert {c.layout.ep for c in ranked} > {4} and all(c.phase_cp[3] == 8 for c in ranked)


def test_nothing_fits_is_one_line_naming_the_smallest_shortfall():
    config, run, cluster, ranked = _search(tuple(AUTO), 1, "h100")
    with pytest.raises(ZayaError) as caught:
        choose(config, run, cluster)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{BASE}: parallel.layout = \"auto\": no layout of 1 rank(s)")
    assert "GB short" in message and "the closest, dp_replicate 1 x dp_shard 1" in message
    smallest = min(c.shortfall for c in ranked if c.shortfall > 0)
    assert f"is {smallest / 1e9:.2f} GB short" in message


def test_a_choice_is_kept_in_the_cache_and_a_file_not_its_own_is_left_alone(tmp_path, monkeypatch):
    config, run, cluster, _ = _search(tuple(AUTO), 8)
    first = choose(config, run, cluster, cache=LayoutCache(tmp_path))
    kept = list((tmp_path / "layouts").iterdir())
    assert len(kept) == 1

    def no_search(*args, **kwargs):
        raise AssertionError("searched again")

    monkeypatch.setattr(auto, "search_layouts", no_search)
    again = choose(config, run, cluster, cache=LayoutCache(tmp_path))
    assert (again.values, again.line, again.runner_up) == (first.values, first.line, first.runner_up)
    with pytest.raises(AssertionError):  # another cluster is another key
        choose(config, run, _cluster(8, per_node=4), cache=LayoutCache(tmp_path))
    monkeypatch.undo()
    # a file of someone else's where the choice would go: read as nothing, never replaced
    foreign = kept[0]
    foreign.write_text("not a layout", encoding="utf-8")
    choose(config, run, cluster, cache=LayoutCache(tmp_path))
    assert foreign.read_text(encoding="utf-8") == "not a layout"
    # a read-only cache (`--print-config`, `zaya plan`) writes nothing
    choose(config, run, cluster, cache=LayoutCache(tmp_path / "other", writable=False))
    assert not (tmp_path / "other").exists()


def test_a_checkpoints_record_gives_back_the_layout_chosen():
    config, run, cluster, ranked = _search(tuple(AUTO), 64)
    choice = choose(config, run, cluster, ranked=ranked)
    record = json.loads(json.dumps(choice.config.resolve(64, "bf16").record))  # as a checkpoint holds it
    assert recorded_values(record) == choice.values
    assert apply_layout(config, recorded_values(record)).to_dict() == choice.config.to_dict()
    explicit = load_config(BASE, OWN).resolve(64, "bf16").record
    assert recorded_values(explicit) is None  # a run that did not choose keeps nothing


def _rows(plan, factor: float, memory_factor: float = 1.0) -> list[dict]:
    phase = plan.first
    return [{"step": step, "phase": phase.name, "batch_size": phase.batch_tokens // phase.seq_len,
             "step_time": phase.time.total * factor, "comm_bytes": [phase.traffic.total],
             "peak_memory_bytes": [phase.memory.total * memory_factor]} for step in range(1, 23)]


@pytest.mark.parametrize("factor,memory,warned", [(1.1, 1.0, False), (2.0, 1.0, True), (1.0, 1.5, True),
                                                  (0.5, 1.0, True)])
def test_a_measured_step_off_the_plan_says_so_with_the_runner_up(factor, memory, warned):
    choice = _choose(tuple(AUTO), 64)
    chosen = choice.config.resolve(64, "bf16")
    forecast = Forecast(plan_run(chosen, get_device("mi300x"), None, 8), run=chosen)
    forecast.runner_up = choice.runner_up
    lines = [line for row in _rows(forecast.plan, factor, memory) for line in [forecast.observe(row)] if line]
    assert len(lines) == 1
    text = lines[0].splitlines()
    assert len(text) == (2 if warned else 1) and text[0].startswith("measured over steps 2-21")
    if warned:
        assert text[1].startswith("warning: the ") and "more than the 25%" in text[1]
        assert "the runner-up, dp_replicate" in text[1] and "--calibrate-from" in text[1]


def test_zaya_plan_plans_the_layout_auto_launches(capsys):
    args = ["plan", str(BASE), "--gpus", "64", "--device", "mi300x"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    choice = _choose(tuple(AUTO), 64)
    best = next(c for c in _search(tuple(AUTO), 64)[3] if not c.reason)
    assert data["layout_auto"]["settings"] == choice.settings
    assert data["mfu"] == pytest.approx(best.plan.mfu, rel=1e-12) and data["hours"] == pytest.approx(best.hours)
    assert [phase["cp"] for phase in data["phases"]] == list(best.phase_cp)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(choice.line + "\nplan of ")
    # a config that names its own layout plans that one, as before
    assert main([*args, "--json", "--set", 'parallel.layout="config"']) == 0
    assert json.loads(capsys.readouterr().out)["layout_auto"] is None


@pytest.mark.parametrize("text,sets,given", [
    ("[parallel]\ndp_shard = -1\nep = 2\n", [], {"parallel.ep"}),
    ("[train]\nmicro_batch_size = 2\n[[phases]]\nname = \"a\"\ntokens = 100\ncp = 2\n"
     "[[phases]]\nname = \"b\"\ncp = 0\n", ["parallel.sharding=\"zero1\""],
     {"train.micro_batch_size", "phases.0.cp", "parallel.sharding"}),
    ("[parallel]\ndp_shard = 4\n", ["parallel.cp=2"], {"parallel.dp_shard", "parallel.cp"}),
], ids=["file", "phases-and-set", "shard"])
def test_the_keys_a_config_gives_are_known(tmp_path, text, sets, given):
    path = tmp_path / "run.toml"
    path.write_text(f'[data]\npath = "data"\n{text}', encoding="utf-8")
    config = load_config(path, sets)
    assert config.given == given
    assert "given" not in config.to_dict() and load_config(path, sets) == config


def test_of_layouts_the_predictions_cannot_tell_apart_the_leanest_is_chosen():
    # ZAYA1-8B on 8 H100: ep 4 is predicted 0.1% faster than ep 8 and needs 6 GB more of the 80
    config = load_config(ROOT / "configs" / "zaya1-8b.toml")
    run, cluster = config.resolve(8, "bf16"), _cluster(8, "h100")
    ranked = search_layouts(run, 8, cluster.device, constraints=Constraints.of_config(config, run))
    fitting = [c for c in ranked if not c.reason]
    fastest = min(fitting, key=lambda c: c.hours)
    first = fitting[0]
    assert first is not fastest and first.hours <= fastest.hours * (1 + NEAR)
    assert first.peak_memory == min(c.peak_memory for c in fitting if c.hours <= fastest.hours * (1 + NEAR))
    assert first.peak_memory < fastest.peak_memory - 5e9
    assert choose(config, run, cluster, ranked=ranked).values["parallel.ep"] == first.layout.ep == 8
