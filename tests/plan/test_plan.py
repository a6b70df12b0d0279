"""`zaya plan`: the counts it shares with `zaya params` and `zaya.model.flops`, ZAYA1-base on the reference
clusters, the layout search, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runs import ZAYA1_BASE_HAND
from zaya.cli import main
from zaya.config import load_config
from zaya.model.flops import training_flops_per_token
from zaya.model.params import parameter_report
from zaya.model.presets import PRESETS, get_preset
from zaya.plan.devices import get_device
from zaya.plan.layout import Layout
from zaya.plan.planner import plan_run
from zaya.plan.search import NEAR, layouts, search_layouts
from zaya.plan.timing import SYNC_S, host_seconds, op_counts
from zaya.train.stats import HOST_READS_PER_STEP

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "zaya1-base.toml"


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_counts_are_those_of_zaya_params_and_the_flops_convention(preset):
    config = load_config(ROOT / "configs" / "small.toml", [f"model.preset={preset!r}".replace("'", '"'),
                                                          "data.seq_len=1024"])
    plan = plan_run(config.resolve(8), get_device("h100")).to_dict()
    report = parameter_report(get_preset(preset, temp_init=1.0))
    assert (plan["params_total"], plan["params_active"], plan["params_embedding"]) == \
        (report.total, report.active, report.embedding)
    assert plan["flops_per_token"] == pytest.approx(training_flops_per_token(get_preset(preset), 1024), rel=1e-12)


def test_zaya1_base_fits_on_1024_mi300x_with_fsdp_alone(capsys):
    hand = [item for setting in ZAYA1_BASE_HAND for item in ("--set", setting)]
    plan = _plan_json(capsys, str(BASE), "--gpus", "1024", "--gpus-per-node", "8", "--device", "mi300x", *hand)
    assert plan["fits"] and not plan["problems"]
    assert plan["memory_per_gpu"]["total"] < 192e9
    # no expert or tensor parallelism: every parameter is in the FSDP shards, the experts whole
    assert plan["layout"]["dp_replicate"] * plan["layout"]["dp_shard"] == 1024
    assert [p["name"] for p in plan["phases"]] == ["pretrain-web", "math-code", "long-context", "sft"]
    assert plan["phases"][2]["seq_len"] == 32768 and plan["phases"][2]["cp"] == 8
    assert all(p["hours"] > 0 and p["tokens"] > 0 for p in plan["phases"])
    for key in ("params_total", "params_active", "flops_per_token", "memory_per_gpu", "fits", "comm_bytes_per_step",
                "step_time_s", "tokens_per_s_per_gpu", "mfu", "phases"):
        assert key in plan
    assert 0 < plan["mfu"] < 1
    assert plan["tokens_per_s_per_gpu"] == pytest.approx(4096 * 2048 / plan["step_time_s"] / 1024, rel=1e-6)


def test_one_h100_does_not_fit_and_the_smallest_layout_that_does_is_named(capsys):
    plan = _plan_json(capsys, str(BASE), "--gpus", "1", "--device", "h100")
    assert not plan["fits"]
    # the fp32 master shards, gradients and optimizer state of 8.8B parameters alone exceed 80 GB
    state = sum(plan["memory_per_gpu"][k] for k in ("parameters", "gradients", "optimizer_state"))
    assert state > 80e9
    smallest = plan["smallest_fit"]
    assert smallest["gpus"] > 1 and smallest["layout"]["gpus"] == smallest["gpus"]
    # and that layout does fit when planned on its own
    layout = Layout(**smallest["layout"])
    assert plan_run(load_config(BASE).resolve(layout.gpus), get_device("h100"), layout=layout,
                    phase_cp=tuple(smallest["phase_cp"])).fits
    assert plan_run(load_config(BASE, smallest["settings"]).resolve(layout.gpus), get_device("h100")).fits
    text_code = main(["plan", str(BASE), "--gpus", "1", "--device", "h100"])
    out = capsys.readouterr().out
    assert text_code == 0 and "does NOT fit" in out and "smallest layout that fits" in out


def test_devices_are_listed_in_lower_case(capsys):
    assert main(["plan", "--devices"]) == 0
    out = capsys.readouterr().out
    for name in ("mi300x", "mi325x", "mi355x", "h100", "h200", "b200", "local"):
        assert f"\n{name} " in "\n" + out


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "H100"], "unknown device 'H100'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "h100", "--gpus", "8", "--set", "parallel.dp_shard=3"], "dp_replicate x dp_shard x cp"),
    (["--device", "h100", "--gpus", "3"], "does not divide"),
    (["--device", "h100", "--gpus", "0"], "--gpus"),
], ids=["capitalised", "unknown", "layout-product", "batch", "no-gpus"])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["plan", str(BASE), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


def test_search_ranks_fitting_layouts_and_gives_reasons_for_the_rest():
    run = load_config(BASE).resolve(64)
    ranked = search_layouts(run, 8, get_device("h100"))
    # one candidate per layout but cp: each phase takes its fastest cp that fits
    bases = {(layout.dp_replicate, layout.ep, layout.micro_batch_size, layout.activation_checkpointing,
              layout.sharding) for layout in layouts(run, 8)}
    assert len(ranked) == len(bases)
    fitting = [c for c in ranked if not c.reason]
    rejected = [c for c in ranked if c.reason]
    assert fitting and rejected
    assert ranked[:len(fitting)] == fitting  # fitting first ...
    hours = [c.hours for c in fitting]
    assert hours[1:] == sorted(hours[1:])  # ... fastest first, but for the first place: the leanest of the ties
    near = [c for c in fitting if c.hours <= min(hours) * (1 + NEAR)]
    assert fitting[0] in near and fitting[0].peak_memory == min(c.peak_memory for c in near)
    # cp = 2 or 4 cannot run the long-context phase's cp = 8 with every dp_replicate: each says why
    assert all(c.reason for c in rejected)
    assert any("needs" in c.reason and "GB" in c.reason for c in rejected) or any("cp" in c.reason for c in rejected)
    for candidate in fitting[:3]:
        assert candidate.plan.first.memory.total <= 80e9


def test_a_group_spans_nodes_only_when_its_members_do():
    layout = Layout(32, 8, 4, 4, 2, 1, "none")
    assert not layout.spans_nodes(2, 1)  # cp pairs: neighbours
    assert not layout.spans_nodes(8, 1)  # dp_shard x cp: one node
    assert layout.spans_nodes(4, 8)  # replicas: one per node
    assert Layout(16, 8, 1, 16, 1, 1, "none").spans_nodes(16, 1)
    assert not Layout(6, 6, 1, 3, 2, 1, "none").spans_nodes(3, 2)
    assert Layout(12, 6, 1, 4, 3, 1, "none").spans_nodes(4, 3)


def test_more_gpus_need_less_state_per_gpu_and_checkpointing_less_activation_memory():
    from zaya.plan.inventory import inventory

    config = load_config(BASE)
    eight, sixty_four = (plan_run(config.resolve(n), get_device("h200")).first.memory for n in (8, 64))
    routers = 4 * inventory(config.resolve(8).model).replicated_numel  # whole on every rank
    assert 0 < routers < sixty_four.parameters - routers < (eight.parameters - routers) / 7
    modes = plan_run(config.resolve(8), get_device("h200")).first.activations_by_mode
    assert modes["full"] < modes["moe"] < modes["none"]


def test_the_host_is_charged_for_the_kernels_it_issues_and_for_its_reads():
    config = get_preset("micro")
    ops = op_counts(config)
    assert ops.syncs_per_block == ops.syncs_outside == 0  # the model reads nothing back
    assert 0 < ops.lib_calls_per_block < ops.per_block
    eager, reads = host_seconds(config, Layout(1, 1, 1, 1, 1, 2, "none", compiled=False), 2, 5e-6)
    compiled, compiled_reads = host_seconds(config, Layout(1, 1, 1, 1, 1, 2, "none", compiled=True), 2, 5e-6)
    assert reads == compiled_reads == HOST_READS_PER_STEP
    assert compiled < eager / 2
    # on an accelerator the kernels hide behind a big step's compute; the read does not
    run = load_config(BASE, ["model.num_hidden_layers=4", "train.global_batch_size=1", "train.micro_batch_size=1",
                             "data.ramp_start=0"]).resolve(1, "bf16")
    time = plan_run(run, get_device("h200")).first.time
    assert time.overhead == pytest.approx(HOST_READS_PER_STEP * (SYNC_S + 5e-6))


def test_zero2_and_zero1_send_the_same_bytes_for_any_micro_batches_and_keep_whole_gradients():
    from zaya.plan.inventory import inventory
    from zaya.plan.memory import memory_per_gpu
    from zaya.plan.traffic import step_traffic

    config = load_config(BASE).resolve(1024).model
    full, zero2 = (Layout(1024, 8, 128, 8, 1, 1, "none", sharding=mode) for mode in ("full", "zero2"))
    fsdp = {(layout.sharding, m): sum(v for k, v in step_traffic(config, layout, 4096, "bf16", m).by_kind.items()
                                      if k.startswith("fsdp_")) for layout in (full, zero2) for m in (1, 4)}
    assert fsdp["zero2", 4] == fsdp["zero2", 1] < fsdp["full", 1]  # no second gathering in backward either
    assert fsdp["full", 4] == pytest.approx(4 * fsdp["full", 1])
    buffers = {(layout.sharding, m): memory_per_gpu(config, layout, 4096, "bf16", micro_batches=m).communication_buffers
               for layout in (full, zero2) for m in (1, 4)}
    assert buffers["full", 4] == buffers["full", 1] < buffers["zero2", 1]  # every block gathered at once
    assert buffers["zero2", 4] - buffers["zero2", 1] == 4 * inventory(config).numel  # whole fp32 gradients
    # ZeRO-1: ZeRO-2's bytes and memory, its gathering after the update exposed
    zero1 = Layout(1024, 8, 128, 8, 1, 1, "none", sharding="zero1")
    assert step_traffic(config, zero1, 4096, "bf16", 4).by_kind == step_traffic(config, zero2, 4096, "bf16", 4).by_kind
    assert memory_per_gpu(config, zero1, 4096, "bf16", micro_batches=4).total == \
        memory_per_gpu(config, zero2, 4096, "bf16", micro_batches=4).total
    run = load_config(BASE).resolve(8)  # one node, where the blocks' compute hides ZeRO-2's gathering
    times = {mode: plan_run(run, get_device("mi300x"), None, 8, Layout(8, 8, 1, 8, 1, 4, "full", sharding=mode))
             .first.time for mode in ("zero1", "zero2")}
    assert times["zero1"].comm_exposed > 5 * times["zero2"].comm_exposed


def test_the_search_weighs_every_sharding_mode_and_prints_the_settings_of_the_fastest(capsys):
    assert main(["plan", str(BASE), "--gpus", "64", "--device", "h100", "--search", "--top", "1"]) == 0
    out = capsys.readouterr().out
    fastest = out.split("the fastest, applied: ")[1].splitlines()[0]
    assert fastest.startswith(f"zaya train {BASE} --set ")
    sets = fastest.removeprefix(f"zaya train {BASE} ").split()
    overrides = [value for flag, value in zip(sets[::2], sets[1::2], strict=True) if flag == "--set"]
    assert {o.split("=")[0] for o in overrides} >= {"parallel.sharding", "parallel.dp_replicate", "parallel.dp_shard"}
    run = load_config(BASE, overrides).resolve(64)  # the line applies: planned as it is, it is the fastest
    planned = plan_run(run, get_device("h100"))
    listed = out.split("; the fastest:\n")[1].splitlines()[0]
    assert f"{planned.tokens_per_s_per_gpu:,.0f} tok/s/GPU" in listed
    # the answer comes first, the config's own layout after it; numbers are numbers
    assert out.index("layouts fit on 64 x h100") < out.index("the fastest, applied") < out.index("plan of ")
    rejected = out.split("rejected:\n")[1].split("\n\n")[0].splitlines() if "rejected:" in out else []
    assert all(" N " not in line and " like dp_replicate" in line for line in rejected), rejected
    assert {layout.sharding for layout in layouts(run, 8)} == {"full", "zero2", "zero1"}
