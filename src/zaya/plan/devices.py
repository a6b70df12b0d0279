"""The accelerators a run can be planned for: published peaks, memory and link bandwidths, and the local device
as `zaya shapes` measured it.

Every figure of a published device is the vendor's datasheet value (URLs in `sources`), with these readings:
- `peak_flops` are dense figures, without the 2:4 structured-sparsity doubling the datasheets print next to
  them; "fp32" is the vector (non-tensor) FP32 peak.
- memory sizes are decimal, as vendors state them (192 GB = 192e9 bytes); the usable memory torch reports
  differs a little (some is reserved by the driver, and some parts count their HBM in GiB), so a plan that
  fits in the decimal figure fits on the device.
- `intra_node_bandwidth` is the peak per direction of all of a GPU's scale-up links together (NVLink, Infinity
  Fabric), which a ring collective over the node's 8 GPUs can use; measured collective bandwidth is lower
  (typically 70-85% of it), which the planner accounts for, not this table.
- `inter_node_bandwidth` is one 400 Gb/s NIC per GPU (50 GB/s per direction), as in the reference clusters:
  ZAYA1 was trained on MI300X nodes with one AMD Pollara 400 NIC per GPU, and DGX H100/H200/B200 nodes have
  one 400 Gb/s ConnectX-7 per GPU.
- `gemm_efficiency` is an assumption, not a datasheet figure: the fraction of the bf16 peak that large,
  well-shaped bf16 GEMMs reach. 0.75 for NVIDIA's parts and 0.55 for AMD's follow the third-party GEMM
  measurements in `_GEMM_SOURCE` (H100/H200 with cuBLASLt near 700-750 of 989 TFLOP/s; MI300X with
  hipBLASLt near 600-750 of 1307); for MI355X and B200 the same fractions are carried over unmeasured.
  `zaya shapes` on the device replaces the assumption with measurements.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zaya.device import STARTUP_MEASURE_S, accelerator_name, device_label, measure_matmul_flops
from zaya.errors import ZayaError
from zaya.owned import write_output
from zaya.reading import open_regular, parse_json
from zaya.schema import is_a

if TYPE_CHECKING:
    from zaya.plan.table import EfficiencyTable


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the planner sees it (bytes, seconds and FLOPs; see the module docstring)."""

    name: str  # lower-case key: "mi300x", ..., "local"
    label: str
    peak_flops: dict[str, float]  # dense FLOP/s by precision: at least "bf16" and "fp32"
    memory_bytes: int  # device memory (HBM); "local": the GPU's memory, or the host's RAM on a CPU
    memory_bandwidth: float  # bytes/s of device memory; "local": measured
    intra_node_bandwidth: float  # bytes/s per GPU per direction over the scale-up links
    inter_node_bandwidth: float  # bytes/s per GPU per direction over the network
    gpus_per_node: int
    gemm_efficiency: float  # fraction of the bf16 peak large, well-shaped GEMMs reach in practice
    sources: tuple[str, ...]
    host: bool = False  # a CPU: each rank is a process, and its memory is the host's
    # what a run measured against the plan (`zaya.plan.calibration`): the predicted compute time and memory are
    # multiplied by these; 1.0 and "" where the device is not calibrated
    compute_factor: float = 1.0
    memory_factor: float = 1.0
    calibrated_from: str = ""  # the run directory the factors were measured in

    @property
    def unit(self) -> str:
        """What one rank runs on, for "per ..." in messages."""
        return "CPU process" if self.host else "GPU"


_NIC_400G = 400e9 / 8  # one 400 Gb/s NIC per GPU, per direction
_GEMM_SOURCE = "https://semianalysis.com/2024/12/22/mi300x-vs-h100-vs-h200-benchmark-part-1-training/"
_NVIDIA_EFFICIENCY = 0.75
_AMD_EFFICIENCY = 0.55

DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="mi300x",
            label="AMD Instinct MI300X (OAM)",
            peak_flops={"bf16": 1307.4e12, "fp16": 1307.4e12, "fp32": 163.4e12},
            memory_bytes=192 * 10**9,
            memory_bandwidth=5.3e12,
            # 7 Infinity Fabric links of 128 GB/s (bidirectional) each: 7 x 64 GB/s per direction
            intra_node_bandwidth=448e9,
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_AMD_EFFICIENCY,
            sources=(
                "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
                "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
                "amd-instinct-mi300x-data-sheet.pdf",
                _GEMM_SOURCE,
            ),
        ),
        DeviceSpec(
            name="mi325x",
            label="AMD Instinct MI325X (OAM)",
            peak_flops={"bf16": 1307.4e12, "fp16": 1307.4e12, "fp32": 163.4e12},  # MI300X's compute dies
            memory_bytes=256 * 10**9,
            memory_bandwidth=6.0e12,
            intra_node_bandwidth=448e9,  # the same 7 Infinity Fabric links as MI300X
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_AMD_EFFICIENCY,
            sources=("https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html", _GEMM_SOURCE),
        ),
        DeviceSpec(
            name="mi355x",
            label="AMD Instinct MI355X (OAM)",
            # 256 CUs at 2.4 GHz: 4096 bf16 FLOPs and 256 fp32 vector FLOPs per CU per clock
            peak_flops={"bf16": 2516.6e12, "fp16": 2516.6e12, "fp32": 157.3e12},
            memory_bytes=288 * 10**9,
            memory_bandwidth=8.0e12,
            # 7 Infinity Fabric links of 153.6 GB/s (bidirectional) each
            intra_node_bandwidth=7 * 153.6e9 / 2,
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_AMD_EFFICIENCY,
            sources=("https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html",),
        ),
        DeviceSpec(
            name="h100",
            label="NVIDIA H100 SXM5 80GB",
            peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
            memory_bytes=80 * 10**9,
            memory_bandwidth=3.35e12,
            intra_node_bandwidth=450e9,  # NVLink 4: 900 GB/s bidirectional
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_NVIDIA_EFFICIENCY,
            sources=("https://www.nvidia.com/en-us/data-center/h100/", _GEMM_SOURCE),
        ),
        DeviceSpec(
            name="h200",
            label="NVIDIA H200 SXM 141GB",
            peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},  # H100's compute die
            memory_bytes=141 * 10**9,
            memory_bandwidth=4.8e12,
            intra_node_bandwidth=450e9,
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_NVIDIA_EFFICIENCY,
            sources=("https://www.nvidia.com/en-us/data-center/h200/", _GEMM_SOURCE),
        ),
        DeviceSpec(
            name="b200",
            label="NVIDIA B200 180GB (DGX/HGX B200)",
            # HGX B200, 8 GPUs: 18 PFLOP/s dense bf16, 600 TFLOP/s fp32; DGX B200: 1,440 GB at 64 TB/s in all
            peak_flops={"bf16": 2.25e15, "fp16": 2.25e15, "fp32": 75e12},
            memory_bytes=180 * 10**9,
            memory_bandwidth=8.0e12,
            intra_node_bandwidth=900e9,  # NVLink 5: 1.8 TB/s bidirectional
            inter_node_bandwidth=_NIC_400G,
            gpus_per_node=8,
            gemm_efficiency=_NVIDIA_EFFICIENCY,
            sources=("https://www.nvidia.com/en-us/data-center/dgx-b200/",
                     "https://www.nvidia.com/en-us/data-center/hgx/"),
        ),
        DeviceSpec(
            name="a100",
            label="NVIDIA A100 SXM4 80GB",
            peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
            memory_bytes=80 * 10**9,
            memory_bandwidth=2.039e12,
            intra_node_bandwidth=300e9,  # NVLink 3: 600 GB/s bidirectional
            inter_node_bandwidth=200e9 / 8,  # DGX A100: one 200 Gb/s HDR NIC per GPU
            gpus_per_node=8,
            gemm_efficiency=_NVIDIA_EFFICIENCY,
            sources=("https://www.nvidia.com/en-us/data-center/a100/",),
        ),
    )
}

# Device-name substrings that share a table key but not its figures (another form factor or memory size):
# such a device is measured rather than looked up.
_NOT_THIS_PART: dict[str, tuple[str, ...]] = {
    "h100": ("pcie", "nvl"),
    "h200": ("gh200", "nvl"),
    "b200": ("gb200",),
    "a100": ("pcie", "40gb"),
}


def device_names() -> list[str]:
    """The names `get_device` accepts: the published devices, then "local"."""
    return [*DEVICES, "local"]


def get_device(name: str, table: EfficiencyTable | None = None) -> DeviceSpec:
    """The device called `name` (lower case). "local" is built from `table`, the one `zaya shapes` measured
    (`zaya.plan.plan_cli.load_target` finds it)."""
    if name == "local":
        if table is None:
            raise ZayaError("the local device needs its measured table: run `zaya shapes` first")
        return local_device(table)
    if name not in DEVICES:
        hint = f"; names are lower-case: '{name.lower()}'" if name.lower() in device_names() else ""
        raise ZayaError(f"unknown device '{name}' (known: {', '.join(device_names())}){hint}")
    return DEVICES[name]


def local_device(table: EfficiencyTable) -> DeviceSpec:
    """The local device from its measured table: measured peaks (the table's dtype and fp32 at least) and
    memory bandwidth, its memory, one device per node. Ranks on one host exchange data through host memory,
    so both link bandwidths are taken as half the measured memory bandwidth (a copy reads and writes each
    byte), an optimistic assumption for gloo. `gemm_efficiency` is the best measured GEMM rate over the
    measured peak, at most 1."""
    peaks = dict(table.peaks)
    peaks.setdefault(table.dtype, table.peak_flops)
    for key in ("bf16", "fp32"):
        peaks.setdefault(key, table.peak_flops)
    best = max((r.rate for r in table.records if r.op != "attention" and r.dtype == table.dtype), default=0.0)
    efficiency = min(1.0, best / table.peak_flops) if best > 0 and table.peak_flops > 0 else 1.0
    link = table.memory_bandwidth / 2
    return DeviceSpec(
        name="local",
        label=f"{table.device_label} (measured {table.measured_at[:10]}, {table.dtype})",
        peak_flops=peaks,
        memory_bytes=table.memory_bytes,
        memory_bandwidth=table.memory_bandwidth,
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        gpus_per_node=1,
        gemm_efficiency=efficiency,
        sources=(),
        host=table.device.split(":")[0] == "cpu",
    )


def match_device(torch_device_name: str) -> DeviceSpec | None:
    """The published device a torch device name denotes ("NVIDIA H100 80GB HBM3" -> h100, "AMD Instinct
    MI300X" -> mi300x), or None: the longest table key found in the name (case-insensitive), unless the name
    marks another form factor of that part (H100 PCIe, GH200, ...)."""
    lowered = torch_device_name.lower()
    for key in sorted(DEVICES, key=len, reverse=True):
        if key in lowered and not any(other in lowered for other in _NOT_THIS_PART.get(key, ())):
            return DEVICES[key]
    return None


def peak_flops(device: torch.device, dtype: torch.dtype, cache: Path | None = None) -> tuple[float, str]:
    """(FLOP/s, source): the published dense peak of a known GPU in bf16 or fp16 (`match_device`), else this
    device's measured matmul rate (`zaya.device.measure_matmul_flops`, the best of three runs of
    `STARTUP_MEASURE_S`), measured once and kept under `cache` (`zaya.plan.table.cache_dir`) for this device,
    thread count, dtype and torch version, so that every run's MFU on one machine has the same denominator
    (measured anew in each process it varied with the machine's load: 30% to 47% between identical runs)."""
    name = accelerator_name(device)
    if name is not None and dtype in (torch.bfloat16, torch.float16):
        spec = match_device(name)
        if spec is not None:
            return spec.peak_flops["bf16"], f"table ({name})"
    dtype_name = str(dtype).removeprefix("torch.")
    key = f"{device_label(device)} {torch.get_num_threads()} threads {dtype_name} torch {torch.__version__}"
    path = None if cache is None else Path(cache) / "peak" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if path is not None:
        saved = _read_peak(path)
        if saved is not None and saved["key"] == key:
            return float(saved["flops"]), f"measured once on this machine, {path}"
    flops = max(measure_matmul_flops(device, dtype, seconds=STARTUP_MEASURE_S) for _ in range(3))
    if path is None:
        return flops, "measured"
    # a cache that cannot be written (read-only, or something not zaya's in its place: never replaced) costs a
    # measurement per run, nothing else
    with contextlib.suppress(OSError, ZayaError):
        if os.path.lexists(path) and _read_peak(path) is None:
            return flops, "measured"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_output(path, json.dumps({"key": key, "flops": flops}), overwrite=True)
        return flops, f"measured, kept in {path}"
    return flops, "measured"


PEAK_CACHE_CAP = 4096  # bytes of a kept peak: {"key": ..., "flops": ...} takes 200


def _read_peak(path: Path) -> dict | None:
    """A peak `peak_flops` kept at `path`, or None for anything else: missing, not a regular file (never read
    through: a FIFO would block), larger than `PEAK_CACHE_CAP`, not JSON, or fields of the wrong type."""
    try:
        with open_regular(path, "a kept peak", follow_links=False) as handle:
            data = handle.read(PEAK_CACHE_CAP + 1)
        saved = parse_json(data, path) if len(data) <= PEAK_CACHE_CAP else None
    except (OSError, ZayaError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("key"), str) or not is_a(saved.get("flops"),
                                                                                      (int, float)):
        return None
    return saved if 0 < saved["flops"] <= 1e30 else None


def describe_devices(cache: Path) -> str:
    """The device table as text (for `zaya plan --devices`, which adds the calibrations found); `cache` is where
    `zaya shapes` keeps this machine's tables (`zaya.plan.table.cache_dir`)."""
    header = (f"{'name':<8} {'label':<34} {'bf16 TFLOP/s':>12} {'memory GB':>9} {'HBM TB/s':>8} "
              f"{'intra GB/s':>10} {'inter GB/s':>10} {'GPUs/node':>9} {'GEMM eff':>8}")
    lines = [header]
    for spec in DEVICES.values():
        lines.append(
            f"{spec.name:<8} {spec.label:<34} {spec.peak_flops['bf16'] / 1e12:>12.1f} {spec.memory_bytes / 1e9:>9.0f} "
            f"{spec.memory_bandwidth / 1e12:>8.2f} {spec.intra_node_bandwidth / 1e9:>10.1f} "
            f"{spec.inter_node_bandwidth / 1e9:>10.1f} {spec.gpus_per_node:>9} {spec.gemm_efficiency:>8.2f}"
        )
    from zaya.plan.table import default_table_path

    measured = [dtype for dtype in ("bf16", "fp32") if _is_file(default_table_path(dtype, cache))]
    state = f"measured: {', '.join(measured)}" if measured else "not measured yet"
    lines.append(f"{'local':<8} {'this machine, by `zaya shapes`':<34} ({state}; "
                 f"{default_table_path('<dtype>', cache)})")
    lines.append("peaks are dense (no sparsity); memory in decimal GB; link bandwidths per GPU per direction; "
                 "GEMM eff is an assumption")
    return "\n".join(lines)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a loop of links: not a table
        return False
