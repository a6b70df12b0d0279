"""`zaya plan` with expert parallelism (`parallel.ep`): the token exchange's bytes, the experts' FSDP2 traffic and
memory over the expert-data-parallel group, the grouped GEMMs and host reads per rank, the search over ep, and
ep = 1 as it was."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from runs import ZAYA1_BASE_HAND
from zaya.cli import main
from zaya.config import load_config
from zaya.plan.devices import get_device
from zaya.plan.inventory import inventory
from zaya.plan.layout import Layout
from zaya.plan.memory import memory_per_gpu
from zaya.plan.planner import bandwidths_for, plan_run
from zaya.plan.search import describe, evaluate, layouts
from zaya.plan.timing import RooflineRates, StepTime, block_gemm_seconds, host_seconds, step_time
from zaya.plan.traffic import Traffic, step_traffic

BASE = Path(__file__).resolve().parents[2] / "configs" / "zaya1-base.toml"


def _pretraining(*sets: str):
    """ZAYA1-base's run without its SFT phase, whose rows of 131k tokens (16k per GPU) need activation
    checkpointing on an 80 GB H100 at any ep: the facts below are the pre-training's."""
    config = load_config(BASE, [*ZAYA1_BASE_HAND, *sets])
    config.phases = [phase for phase in config.phases if phase.name != "sft"]
    return config


@pytest.fixture(scope="module")
def model():
    return load_config(BASE).resolve(64).model


def _experts_numel(model) -> int:
    """Elements of every block's stacked experts (gate_up [E, 2F, D] and down [E, D, F])."""
    E, D, F = model.num_experts, model.hidden_size, model.moe_intermediate_size
    return model.num_hidden_layers * E * 3 * F * D


def test_the_token_exchange_sends_dispatch_and_combine_each_way_and_again_when_recomputed(model):
    D, E, L = model.hidden_size, model.num_experts, model.num_hidden_layers
    tokens, micro_batches, ep = 2 * 4096, 3, 8
    for mode, forwards in (("none", 1), ("moe", 2), ("full", 2)):
        for precision, vector in (("bf16", 2), ("fp32", 4)):
            layout = Layout(64, 8, 1, 64, 1, 2, mode, ep=ep)
            traffic = step_traffic(model, layout, 4096, precision, micro_batches)
            exchange = tokens * D * vector * (ep - 1) / ep  # one all_to_all_single: what leaves the rank
            counts = (ep - 1) * (E // ep) * 8  # int64 token counts to the group's other ranks, per forward
            expected = micro_batches * L * ((2 * forwards + 2) * exchange + forwards * counts)
            assert traffic.by_kind["experts"] == pytest.approx(expected, rel=1e-12)
            assert traffic.by_dimension()["ep"] == traffic.by_kind["experts"]
    assert "experts" not in step_traffic(model, Layout(64, 8, 1, 64, 1, 2, "none"), 4096, "bf16", 3).by_kind


def test_the_experts_gathers_and_reductions_run_over_their_group_on_a_ep_th_of_the_bytes(model):
    one, eight = (Layout(64, 8, 2, 32, 1, 1, "none", sharding="full", ep=ep) for ep in (1, 8))
    before, after = (step_traffic(model, layout, 4096, "bf16", 2).entries for layout in (one, eight))
    experts, n, edp = _experts_numel(model), 32, 4
    # bf16 gathers, twice per micro-batch (forward and backward); fp32 reduce-scatters once
    gathered_before, gathered_after = 2 * 2 * 2 * experts * (n - 1) / n, 2 * 2 * 2 * experts / 8 * (edp - 1) / edp
    reduced_before, reduced_after = 2 * 4 * experts * (n - 1) / n, 2 * 4 * experts / 8 * (edp - 1) / edp
    assert after["fsdp_all_gather", "edp"] == pytest.approx(gathered_after, rel=1e-12)
    assert after["fsdp_reduce_scatter", "edp"] == pytest.approx(reduced_after, rel=1e-12)
    # the other parameters' collectives are as they were
    assert after["fsdp_all_gather", "dp_shard_cp"] == pytest.approx(
        before["fsdp_all_gather", "dp_shard_cp"] - gathered_before, rel=1e-9)
    assert after["fsdp_reduce_scatter", "dp_shard_cp"] == pytest.approx(
        before["fsdp_reduce_scatter", "dp_shard_cp"] - reduced_before, rel=1e-9)
    # the replicas all-reduce shards of numel / (dp_shard x cp) either way
    assert after["fsdp_all_reduce", "dp_replicate"] == pytest.approx(before["fsdp_all_reduce", "dp_replicate"],
                                                                     rel=1e-12)


def test_zero1_keeps_a_ep_th_of_the_experts_whole_and_the_shards_stay_as_they_are(model):
    one, eight = (memory_per_gpu(model, Layout(64, 8, 1, 64, 1, 1, "none", sharding="zero1", ep=ep), 4096, "bf16")
                  for ep in (1, 8))
    experts = _experts_numel(model)
    per_block = experts // model.num_hidden_layers
    # whole bf16 experts of every block, and two blocks' unsharded gradients (fp32 + bf16), each down by 8
    assert one.communication_buffers - eight.communication_buffers == \
        experts * 2 * 7 // 8 + 2 * per_block * (4 + 2) * 7 // 8
    assert (one.parameters, one.gradients, one.optimizer_state, one.optimizer_workspace) == \
        (eight.parameters, eight.gradients, eight.optimizer_state, eight.optimizer_workspace)
    assert one.activations == eight.activations


def test_with_ep_1_nothing_changes(model):
    inv = inventory(model)
    assert inv.sharded_units(1) == inv.units and all(unit.split(1) == (unit,) for unit in inv.units)
    layout = Layout(64, 8, 2, 32, 1, 1, "moe", sharding="zero2")
    assert dataclasses.replace(layout, ep=1) == layout
    traffic = step_traffic(model, layout, 4096, "bf16", 2)
    assert {dim for _, dim in traffic.entries} == {"dp_shard_cp", "dp_replicate", "world"}
    assert set(bandwidths_for(layout, get_device("h100"))) == {"cp", "dp_shard_cp", "dp_replicate", "world"}
    assert "parallel.ep=1" in layout.settings() and "ep 1" in layout.describe()
    assert "parallel.dp_shard=-1" in layout.settings()  # each phase's cp takes its share of the GPUs


class _Recorder:
    """Rates (`zaya.plan.timing.Rates`) that remember the grouped GEMMs asked about."""

    memory_bandwidth, op_overhead_s = 1e12, 5e-6

    def __init__(self) -> None:
        self.grouped: list[tuple[int, int]] = []

    def gemm_rate(self, op, m, n, k, groups=1, dtype=None) -> float:
        if op == "grouped":
            self.grouped.append((m, groups))
        return 1e14

    def attention_rate(self, seq_len, head_dim, heads, kv_heads, **kwargs) -> float:
        return 1e14


def test_a_rank_runs_its_e_over_ep_experts_on_as_many_rows_and_reads_the_split_sizes_once_per_moe_forward(model):
    rates = _Recorder()
    block_gemm_seconds(model, rates, 4096, "bf16", 1.0, backward=False)
    assert rates.grouped == [(4096, model.num_experts)] * 2  # gate/up and down
    rates = _Recorder()
    block_gemm_seconds(model, rates, 4096, "bf16", 1.0, backward=False, ep=4)
    # the same rows over E / 4 experts (4096 x 4 / E rows each): the 1/4 that stay in halves, the 3/4 received
    assert rates.grouped == [(512, model.num_experts // 4)] * 2 + [(3072, model.num_experts // 4)] * 2
    L, micro_batches = model.num_hidden_layers, 3
    reads = {(ep, mode): host_seconds(model, Layout(8, 8, 1, 8, 1, 1, mode, ep=ep), micro_batches, 5e-6)[1]
             for ep in (1, 8) for mode in ("none", "moe")}
    assert reads[8, "none"] - reads[1, "none"] == micro_batches * L
    assert reads[8, "moe"] - reads[1, "moe"] == 2 * micro_batches * L  # the recomputed forward exchanges again


@dataclasses.dataclass(frozen=True)
class _CpuRates(RooflineRates):
    device: str = "cpu"  # as a measured table of a CPU names it


def test_the_exchange_is_exposed_beyond_the_staying_rows_over_the_links_of_its_group(model):
    """Each of a layer's exchanges runs beside half the rows that stay: dispatch and combine beside their
    forward, the gradients' two beside their backward (twice the work), a recomputed forward's two beside it
    again; what a window cannot hold is exposed, and on a CPU, whose cores copy and compute, all of it."""
    layout = Layout(64, 8, 1, 64, 1, 1, "none", ep=8)
    bandwidths = bandwidths_for(layout, get_device("h100"))
    assert bandwidths["ep"] > bandwidths["edp"]  # 8 consecutive ranks: one node; the ranks 8 apart: eight
    assert bandwidths_for(dataclasses.replace(layout, ep=16), get_device("h100"))["ep"] == bandwidths["edp"]
    L, tokens, micro_batches = model.num_hidden_layers, 4096, 2
    for mode, exchanges in (("none", 4), ("moe", 6)):
        layout = dataclasses.replace(Layout(64, 8, 1, 64, 1, 1, mode, ep=8), micro_batch_size=1)
        traffic = step_traffic(model, layout, tokens, "bf16", micro_batches)
        without = Traffic({key: v for key, v in traffic.entries.items() if key[0] != "experts"})
        exchange = traffic.by_kind["experts"] / bandwidths["ep"]
        each = exchange / (micro_batches * L * exchanges)
        # half the 4096 / 8 staying rows through the gate/up [2F, D] and down [D, F] projections, forward
        flops = 2 * (4096 / 8 / 2) * 3 * model.moe_intermediate_size * model.hidden_size
        for peak, regime in ((1e20, "all of each window"), (2e14, "parts"), (1e9, "all of each exchange")):
            rates = RooflineRates({"bf16": peak, "fp32": peak / 2}, 1e20, 1.0)
            half = flops / peak
            if regime == "parts":  # a forward window holds part of an exchange, a backward one all of it
                assert half < each < 2 * half, (half, each)
            hidden_per_layer = (exchanges - 2) * min(each, half) + 2 * min(each, 2 * half)
            times: list[StepTime] = [step_time(model, layout, tokens, "bf16", micro_batches, rates, t, bandwidths)
                                     for t in (without, traffic)]
            assert times[1].comm_exposed - times[0].comm_exposed == pytest.approx(
                exchange - micro_batches * L * hidden_per_layer, rel=1e-9), (mode, peak)
    cpu = _CpuRates(rates.peak_flops, rates.bandwidth, rates.gemm_efficiency)
    times = [step_time(model, layout, tokens, "bf16", micro_batches, cpu, t, bandwidths) for t in (without, traffic)]
    assert times[1].comm_exposed - times[0].comm_exposed == pytest.approx(exchange, rel=1e-9)


def test_the_search_weighs_every_ep_the_experts_and_the_mesh_allow(model):
    run = _pretraining().resolve(64)
    options = layouts(run, 8)
    assert {layout.ep for layout in options} == {1, 2, 4, 8, 16}
    assert all(layout.dp_shard * layout.cp % layout.ep == 0 for layout in options)
    assert {layout.ep for layout in options if layout.dp_replicate == 8} == {1, 2, 4, 8}  # 8 shards per replica
    # compiled as the config says at every ep (with ep > 1 the runtime compiles around the experts)
    assert run.train.compile and all(layout.compiled for layout in options)
    # the layout of ZAYA1-base's config on 64 H100 fits with its experts over 8 ranks, not without
    config_layout = Layout(64, 8, 1, 64, 1, 1, "none", compiled=False, sharding="zero2")
    unsplit, split = (evaluate(run, dataclasses.replace(config_layout, ep=ep), get_device("h100")) for ep in (1, 8))
    assert "needs" in unsplit.reason and not split.reason
    assert "ep  8" in describe(split) and split.plan.first.traffic.by_kind["experts"] > 0
    assert split.layout.settings()[-1] == "train.activation_checkpointing=none"


@pytest.mark.parametrize(("ep", "message"), [
    (32, "16 experts do not split into parallel.ep = 32"),
    (3, "parallel.ep = 3 does not divide"),
], ids=["experts", "mesh"])
def test_an_ep_that_splits_not_the_experts_or_the_mesh_is_refused_in_one_line(capsys, ep, message):
    assert main(["plan", str(BASE), "--gpus", "64", "--device", "h100", "--set", f"parallel.ep={ep}"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and message in lines[0], captured.err
    run = load_config(BASE, ZAYA1_BASE_HAND).resolve(64)
    candidate = evaluate(run, Layout(64, 8, 1, 64, 1, 1, "none", compiled=False, ep=ep), get_device("h100"))
    assert candidate.plan is None and message in candidate.reason


def test_a_compiled_layout_with_ep_is_planned_as_the_runtime_compiles_it():
    run = _pretraining().resolve(64)
    candidate = evaluate(run, Layout(64, 8, 1, 64, 1, 1, "none", compiled=True, ep=8), get_device("h100"))
    assert candidate.plan is not None and not candidate.reason
    # "auto" compiles on accelerators at any ep: the config's own layout plans compiled
    planned = plan_run(_pretraining("parallel.ep=8").resolve(64), get_device("h100"))
    assert planned.first.layout.ep == 8 and planned.first.layout.compiled
