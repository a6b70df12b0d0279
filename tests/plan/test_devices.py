"""The device table: names, published dense peaks, matching torch's device names, the local device."""

from __future__ import annotations

import pytest
import torch

from zaya.errors import ZayaError
from zaya.plan.devices import (
    DEVICES,
    describe_devices,
    device_names,
    get_device,
    local_device,
    match_device,
    peak_flops,
)
from zaya.plan.plan_cli import load_target
from zaya.plan.table import EfficiencyTable, GemmRecord


def test_names_are_lower_case_and_cover_the_reference_devices():
    names = device_names()
    assert all(name == name.lower() for name in names)
    assert {"mi300x", "mi325x", "mi355x", "h100", "h200", "b200", "local"} <= set(names)
    assert names[-1] == "local"
    for name, spec in DEVICES.items():
        assert spec.name == name
        assert {"bf16", "fp32"} <= set(spec.peak_flops)
        assert spec.peak_flops["fp32"] < spec.peak_flops["bf16"]
        assert spec.gpus_per_node == 8 and 0 < spec.gemm_efficiency <= 1
        assert spec.inter_node_bandwidth < spec.intra_node_bandwidth < spec.memory_bandwidth
        assert spec.sources and all(url.startswith("https://") for url in spec.sources)


@pytest.mark.parametrize("name, bf16, memory, bandwidth", [
    ("mi300x", 1307.4e12, 192e9, 5.3e12),
    ("mi325x", 1307.4e12, 256e9, 6.0e12),
    ("mi355x", 2.5e15, 288e9, 8.0e12),
    ("h100", 989e12, 80e9, 3.35e12),
    ("h200", 989e12, 141e9, 4.8e12),
    ("b200", 2.25e15, 180e9, 8.0e12),
])
def test_peaks_are_the_dense_figures(name, bf16, memory, bandwidth):
    spec = get_device(name)
    assert spec.peak_flops["bf16"] == pytest.approx(bf16, rel=0.01)  # not the 2:4-sparsity doubling
    assert spec.memory_bytes == pytest.approx(memory, rel=1e-9)
    assert spec.memory_bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_unknown_or_capitalised_names_are_refused():
    with pytest.raises(ZayaError, match=r"unknown device 'H100' \(known: mi300x, .*lower-case: 'h100'"):
        get_device("H100")
    with pytest.raises(ZayaError, match=r"unknown device 'nope' \(known: .*h100.*local\)$"):
        get_device("nope")


@pytest.mark.parametrize("torch_name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"),
    ("AMD Instinct MI300X VF", "mi300x"),
    ("AMD Instinct MI325X", "mi325x"),
    ("AMD Instinct MI355X", "mi355x"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H100 PCIe", None),  # another part under the same name: measured, not looked up
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_match_device_reads_torch_device_names(torch_name, key):
    spec = match_device(torch_name)
    assert (spec.name if spec else None) == key


def test_peak_flops_takes_known_gpus_from_the_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    value, source = peak_flops(torch.device("cuda"), torch.bfloat16)
    assert value == DEVICES["h100"].peak_flops["bf16"]
    assert source == "table (NVIDIA H100 80GB HBM3)"


def test_peak_flops_measures_the_cpu():
    value, source = peak_flops(torch.device("cpu"), torch.float32)
    assert source == "measured" and value > 1e8


def test_a_cpus_peak_is_measured_once_per_machine_and_kept(monkeypatch, tmp_path):
    readings = iter([3e10, 5e10, 4e10, 1e10, 1e10, 1e10])  # the best of the first three, then a busy machine
    monkeypatch.setattr("zaya.plan.devices.measure_matmul_flops", lambda *args, **kwargs: next(readings))
    first, said = peak_flops(torch.device("cpu"), torch.float32, tmp_path)
    assert first == 5e10 and "kept in" in said
    again, said = peak_flops(torch.device("cpu"), torch.float32, tmp_path)
    assert again == 5e10 and said.startswith("measured once on this machine")
    other, _ = peak_flops(torch.device("cpu"), torch.bfloat16, tmp_path)  # another dtype: its own measurement
    assert other == 1e10


def _table() -> EfficiencyTable:
    return EfficiencyTable(
        device="cpu", device_label="Test CPU", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=5e-6, records=[GemmRecord("dense", 1024, 1024, 1024, 1, "fp32", 0.025, 2 * 1024**3)],
        preset="micro", measured_at="2025-01-01T00:00:00+00:00", torch_version="x",
        peaks={"fp32": 1e11, "bf16": 1e9}, memory_bytes=24 * 10**9, tokens=[1024],
    )


def test_local_device_comes_from_a_measured_table(tmp_path):
    spec = get_device("local", _table())
    assert spec.name == "local" and spec.gpus_per_node == 1 and spec.sources == ()
    assert spec.peak_flops == {"fp32": 1e11, "bf16": 1e9}
    assert spec.memory_bytes == 24 * 10**9 and spec.memory_bandwidth == 2e10
    assert spec.gemm_efficiency == pytest.approx(2 * 1024**3 / 0.025 / 1e11)
    assert spec == local_device(_table())

    with pytest.raises(ZayaError, match=r"the local device needs its measured table: run `zaya shapes` first"):
        get_device("local")
    missing = r"no measured table for the local device at .*local-fp32\.json: run `zaya shapes --dtype fp32` first"
    with pytest.raises(ZayaError, match=missing):
        load_target("local", "fp32", None, tmp_path)
    _table().save(tmp_path / "shapes" / "local-fp32.json")
    assert load_target("local", "fp32", None, tmp_path) == (spec, _table())


def test_describe_devices_lists_every_device(tmp_path):
    text = describe_devices(tmp_path)
    for name in device_names():
        assert f"\n{name} " in text
    assert "1307.4" in text and "989.4" in text and "not measured yet" in text
