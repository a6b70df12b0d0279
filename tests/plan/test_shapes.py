"""`zaya shapes`: the sweep, the table's file and its interpolation, the recommendations and the command."""

from __future__ import annotations

import json
import math

import pytest
import torch

import zaya.device
import zaya.plan.shapes as shapes_module
from zaya.errors import ZayaError
from zaya.model.presets import get_preset
from zaya.plan.gemms import ModelDims, attention_shape, model_gemms, variant_values
from zaya.plan.shapes import sweep
from zaya.plan.shapes_cli import shapes as shapes_command
from zaya.plan.shapes_report import ALIGNMENTS, recommend
from zaya.plan.table import EfficiencyTable, GemmRecord, cache_dir, default_table_path


@pytest.fixture(scope="module")
def table() -> EfficiencyTable:
    return sweep("micro", "cpu", torch.float32, [256], progress=False, budget_s=1.5, seq_lens=[128, 256])


def test_sweep_measures_positive_rates_below_the_peak(table):
    assert table.device == "cpu" and table.dtype == "fp32" and table.preset == "micro"
    assert table.peak_flops > 0 and table.memory_bandwidth > 0 and 0 < table.op_overhead_s < 1e-2
    assert {"fp32", "bf16"} <= set(table.peaks) and table.memory_bytes > 0
    ops = {r.op for r in table.records}
    assert {"dense", "grouped", "attention"} <= ops
    kinds = {r.kind for r in table.records}
    assert {"attn_in", "router_mlp", "expert_gate_up", "lm_head", "attention"} <= kinds
    for r in table.records:
        assert r.seconds > 0 and r.rate > 0
        # the peak and the shapes are timed at different moments; a busy machine shifts either a little
        assert r.rate <= 1.5 * table.peak(r.dtype)


def test_table_round_trips_through_its_file(table, tmp_path):
    path = table.save(tmp_path / "deep" / "table.json")
    assert EfficiencyTable.load(path) == table
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temporary file left behind


def test_bad_files_raise_errors_naming_them(table, tmp_path):
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"format": "zaya-gemm-table", "vers')
    with pytest.raises(ZayaError, match=r"garbled\.json: not valid JSON"):
        EfficiencyTable.load(garbled)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**table.to_dict(), "version": 0}))
    with pytest.raises(ZayaError, match=r"old\.json: GEMM table format version 0"):
        EfficiencyTable.load(old)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**table.to_dict(), "records": [{"op": "dense"}]}))
    with pytest.raises(ZayaError, match=r"broken\.json: missing field 'records\.0\.m'"):
        EfficiencyTable.load(broken)
    with pytest.raises(ZayaError, match=r"missing\.json: no such GEMM table"):
        EfficiencyTable.load(tmp_path / "missing.json")


def test_exact_matches_return_their_measured_rate(table):
    for r in table.records:
        if r.op == "attention":
            assert table.attention_rate(r.m, r.n, r.k, r.groups) == r.rate
        else:
            assert table.gemm_rate(r.op, r.m, r.n, r.k, r.groups, r.dtype) == r.rate
            assert table.efficiency(r.op, r.m, r.n, r.k, r.groups, r.dtype) == r.rate / table.peak(r.dtype)


def test_interpolated_rates_stay_below_the_measured_peak(table):
    best = max(r.rate for r in table.records)
    cap = max(best, table.peak_flops)
    for m in (100, 300, 1000, 5000, 20000):
        for n, k in ((96, 130), (700, 700), (3000, 64)):
            assert 0 < table.gemm_rate("dense", m, n, k) <= cap
            assert 0 < table.gemm_rate("grouped", m, n, k, groups=4) <= cap
    assert 0 < table.attention_rate(700, 16, 4, 2) <= cap


def _synthetic(records: list[tuple[int, int, int, float]]) -> EfficiencyTable:
    return EfficiencyTable(
        device="cpu", device_label="test", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=1e-5, preset="micro", measured_at="2025-01-01T00:00:00+00:00", torch_version="x",
        records=[GemmRecord("dense", m, n, k, 1, "fp32", 2 * m * n * k / rate, 2.0 * m * n * k, "test")
                 for m, n, k, rate in records],
    )


def test_interpolation_lies_between_neighbours_and_falls_off_for_tiny_shapes():
    table = _synthetic([(1024, 1024, 1024, 8e10), (4096, 1024, 1024, 9e10), (1024, 4096, 1024, 7e10),
                        (4096, 4096, 1024, 8.5e10), (64, 64, 64, 2e9)])
    between = table.gemm_rate("dense", 2048, 1024, 1024)
    assert 8e10 * 0.97 <= between <= 9e10  # (the roofline of the two is within 3%)
    assert table.gemm_rate("dense", 2048, 1024, 1024) == between  # cached and deterministic
    assert table.gemm_rate("dense", 8192, 8192, 8192) <= table.peak_flops
    rates = [table.gemm_rate("dense", s, s, s) for s in (4, 16, 64, 256, 1024)]
    assert rates == sorted(rates) and rates[0] < rates[-1] / 100
    assert table.gemm_rate("dense", 64, 64, 64) == pytest.approx(2e9, rel=1e-12)
    # no grouped or attention measurements: the dense efficiencies stand in, under the peak
    assert 0 < table.gemm_rate("grouped", 4096, 1024, 1024, groups=4) <= table.peak_flops
    assert 0 < table.attention_rate(1024, 128, 8, 2) <= table.peak_flops
    with pytest.raises(ZayaError, match="unknown GEMM op"):
        table.gemm_rate("attention", 1, 1, 1)


def test_tiny_shapes_get_lower_rates_than_large_ones(table):
    large = table.gemm_rate("dense", 256, 512, 128)
    assert table.gemm_rate("dense", 8, 8, 8) < large / 10
    assert table.gemm_rate("grouped", 16, 8, 8, groups=4) < table.gemm_rate("grouped", 256, 128, 128, groups=4)


def test_model_gemms_follow_the_layers():
    config = get_preset("zaya1-base")
    shapes = {s.kind: s for s in model_gemms(config, 4096)}
    assert (shapes["attn_in"].m, shapes["attn_in"].n, shapes["attn_in"].k) == (4096, 1024 + 2 * 256, 2048)
    assert (shapes["attn_out"].n, shapes["attn_out"].k) == (2048, 1024)
    assert shapes["router_down"].fp32 and shapes["router_mlp"].count == 80
    assert (shapes["router_out"].n, shapes["expert_gate_up"].groups) == (17, 16)
    assert (shapes["expert_gate_up"].n, shapes["expert_down"].k) == (4096, 2048)
    assert (shapes["lm_grad_weight"].m, shapes["lm_grad_weight"].k) == (262_272, 4096)
    attention = attention_shape(config, 4096)
    assert attention.flops == 3 * 4 * 8 * 128 * 4096 * 4097 / 2
    # forward FLOPs of the layers' GEMMs: 2 x tokens x the matmul parameters, convolutions aside
    dims = ModelDims.from_config(config)
    per_token = sum(s.count * s.flops for s in shapes.values() if not s.kind.startswith("lm_grad")) / 4096
    layer = 2048 * 1536 + 1024 * 2048 + 2048 * 256 + 2 * 256 * 256 + 256 * 17 + 3 * 2048 * 2048
    assert per_token == 2 * (dims.num_hidden_layers * layer + 262_272 * 2048)


def test_variant_values_cover_scales_and_misalignments():
    values = variant_values(256)
    assert values[0] == 256 and {257, 264, 248, 272, 288, 128, 192, 320, 384, 512} <= set(values)
    assert len(values) == len(set(values)) and min(variant_values(8)) > 0


def test_recommendations_come_from_the_measurements(table):
    recommendations = {r.dimension: r for r in recommend(table)}
    assert set(recommendations) <= {"hidden_size", "moe_intermediate_size", "head_dim"}
    assert "hidden_size" in recommendations
    for rec in recommendations.values():
        assert rec.tokens == 256 and rec.preset_value in rec.efficiency
        assert all(0 < e <= 1.5 for e in rec.efficiency.values())
        assert rec.best in rec.efficient and rec.multiple in (*ALIGNMENTS, None)
        assert json.loads(json.dumps(rec.to_dict()))["dimension"] == rec.dimension


def test_default_table_path_follows_the_cache_variables(tmp_path):
    cache = cache_dir({"ZAYA_CACHE": str(tmp_path / "z"), "XDG_CACHE_HOME": str(tmp_path / "x")})
    assert default_table_path("bf16", cache) == tmp_path / "z" / "shapes" / "local-bf16.json"
    cache = cache_dir({"XDG_CACHE_HOME": str(tmp_path / "x")})
    assert default_table_path("fp32", cache) == tmp_path / "x" / "zaya" / "shapes" / "local-fp32.json"


# ---- the command -------------------------------------------------------------------------------------------


@pytest.fixture
def quick(monkeypatch):
    """Stand-ins for the device measurements that take seconds, so the command's tests time shapes only."""
    monkeypatch.setattr(zaya.device, "measure_matmul_flops", lambda device, dtype, **_: 1e11)
    monkeypatch.setattr(shapes_module, "measure_bandwidth", lambda device, megabytes=64: 2e10)


@pytest.fixture
def zaya_cli(cli, monkeypatch):
    from zaya.cli import cli as group

    monkeypatch.setitem(group.commands, "shapes", shapes_command)
    return cli


def test_command_writes_the_table(zaya_cli, quick, tmp_path):
    out = tmp_path / "table.json"
    code, stdout, stderr = zaya_cli("shapes", "--preset", "micro", "--tokens", "256", "--out", out,
                                    "--no-progress", "--budget-s", "1")
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and "attn_in (dense, fp32)" in stdout and "hidden_size (preset 128" in stdout
    table = EfficiencyTable.load(out)
    assert table.preset == "micro" and table.tokens == [256] and table.records


def test_command_prints_json(zaya_cli, quick, tmp_path):
    out = tmp_path / "t.json"
    code, stdout, _ = zaya_cli("shapes", "--preset", "micro", "--tokens", "256", "--out", out, "--json",
                               "--budget-s", "0.5")
    assert code == 0
    payload = json.loads(stdout)
    assert payload["path"] == str(out) and payload["table"]["format"] == "zaya-gemm-table"
    assert isinstance(payload["recommendations"], list)
    assert EfficiencyTable.from_dict(payload["table"]) == EfficiencyTable.load(out)


@pytest.mark.parametrize("args, message", [
    (["--device", "h100"], "--device must be 'local'"),
    (["--tokens", "256,x"], "--tokens must be comma-separated integers"),
    (["--preset", "nope"], "unknown model preset 'nope'"),
])
def test_command_refuses_bad_input_in_one_line(zaya_cli, quick, tmp_path, args, message):
    code, stdout, stderr = zaya_cli("shapes", "--out", tmp_path / "t.json", *args)
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and message in stderr
    assert not (tmp_path / "t.json").exists()


def test_rates_are_finite(table):
    assert all(math.isfinite(r.rate) for r in table.records)
