"""The GPU probe: uncorrectable ECC errors and GPUs that fall off the bus, read through one backend.

It reports `gpu_ecc` when an uncorrectable ECC counter rose since the previous reading (count: the new
errors) or, through amdgpu sysfs, more VRAM pages were retired (count: the new pages), and `gpu_lost` when a
GPU listed before is gone from the backend's answer; the subject is `gpu:I`. The rules every probe follows
(the first poll is the baseline, a failing read never raises) are described in `zaya.resilience.probes`,
which builds this probe with the others.

GPU backends (`ProbeConfig.gpu`):

    nvidia-smi   `nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,
                 ecc.errors.uncorrected.aggregate.total --format=csv,noheader,nounits`; GPUs are told apart by
                 their PCI bus id, so one that drops out cannot shift the others' indices
    amd-smi      `amd-smi metric --ecc --json` (a JSON list, or the `{"gpu_data": [...]}` of newer releases),
                 field `ecc.total_uncorrectable_count`
    sysfs        the amdgpu RAS counters, /sys/class/drm/cardN/device/ras/*_err_count ("ue: N" and "ce: N"
                 lines, one file per hardware block) and ras/gpu_vram_bad_pages; GPU I is the I-th card, in
                 numeric order of N, among those with a device/ras directory at the first poll
    rocm-smi     the same sysfs counters: `rocm-smi --showrasinfo` reads them too, but prints its table only
                 as text (with --json it prints none), so there is nothing better to parse
    auto         nvidia-smi if its command is on PATH, else amd-smi if its command is, else sysfs if any card
                 has RAS counters, else no GPU probe
    none         no GPU probe
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding, clip
from zaya.resilience.probe_config import ProbeConfig
from zaya.resilience.readings import COUNTER_BOUND, ReadError, is_int, read_text, run_command, shown

NVIDIA_SMI_ARGS = [
    "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total",
    "--format=csv,noheader,nounits",
]
AMD_SMI_ARGS = ["metric", "--ecc", "--json"]
MAX_GPUS = 1 << 16  # a GPU index a tool prints beyond this is not one


# ---- GPUs ------------------------------------------------------------------------------------------------


@dataclass
class _GpuReading:
    """One GPU in one answer of a backend."""

    index: int  # the backend's index, kept from the first sighting
    label: str  # how the GPU is named in messages (a bus id, "gpu 3", a sysfs directory)
    ecc: dict[str, int | None]  # uncorrectable error counters by name; None where the tool cannot say
    # True when the counters count the same errors (nvidia's volatile and aggregate totals), so the largest
    # increase is the news; False when they are disjoint (amdgpu's blocks), so increases add up
    overlapping: bool
    evidence: dict[str, str]  # counter name -> the line it was read from
    retired_pages: int | None = None
    pages_evidence: str = ""


@dataclass
class _GpuSnapshot:
    readings: dict[str, _GpuReading]  # by a key that stays the GPU's across polls
    complete: bool  # every GPU present is listed, so a missing one is lost
    mentions: dict[str, str] = field(default_factory=dict)  # key -> an error line naming that GPU
    error: str | None = None  # what went wrong though the answer is still usable


@dataclass
class _GpuState:
    index: int
    label: str
    ecc: dict[str, int] = field(default_factory=dict)
    retired_pages: int | None = None
    lost: bool = False


_BUS_ID = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


def _bus_key(text: str) -> str | None:
    """A PCI address in a canonical form: nvidia-smi writes the domain with 8 digits in its CSV and 4 in errors."""
    match = _BUS_ID.search(text)
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus}:{device}.{function}".lower()


def _counter(text: str) -> int | None:
    """An unsigned 64-bit counter written in decimal, None for anything else (a note, a number of 400 digits)."""
    text = text.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        return None
    value = int(text)
    return value if value < COUNTER_BOUND else None


def _smi_value(text: str) -> int | None:
    """A counter from nvidia-smi's CSV: "[N/A]", "[Not Supported]" and other bracketed notes are unknown."""
    return _counter(text)


def _json_count(value: Any) -> int | None:
    """A counter from amd-smi's JSON: an integer, or "N/A" when unsupported."""
    if is_int(value):
        return value if 0 <= value < COUNTER_BOUND else None
    if isinstance(value, str):
        return _counter(value)
    return None


class GpuProbe:
    """Uncorrectable ECC errors and GPUs that fall off the bus, read through one backend (see the module doc)."""

    name = "gpu"

    def __init__(self, config: ProbeConfig, backend: str):
        if backend not in ("nvidia-smi", "amd-smi", "sysfs"):
            raise ZayaError(f"GpuProbe: backend must be nvidia-smi, amd-smi or sysfs, got {backend!r}")
        self.config = config
        self.backend = backend
        self.last_error: str | None = None
        self._root = Path(config.root)
        self._gpus: dict[str, _GpuState] = {}

    def poll(self) -> list[Finding]:
        """Read the backend once; report counter increases and GPUs gone since the previous poll."""
        try:
            snapshot = self._read()
        except ReadError as exc:
            self.last_error = str(exc)
            return []
        self.last_error = snapshot.error
        findings = []
        for key, reading in snapshot.readings.items():
            state = self._gpus.get(key)
            if state is None or state.lost:
                # first sighting, or back after a reset: whatever its counters hold is history
                index = reading.index if state is None else state.index
                self._gpus[key] = _GpuState(index, reading.label, _known(reading.ecc), reading.retired_pages)
                continue
            findings += self._compare(state, reading)
        for key, state in self._gpus.items():
            if state.lost or key in snapshot.readings or not (snapshot.complete or key in snapshot.mentions):
                continue
            state.lost = True
            line = snapshot.mentions.get(key, f"{state.label} missing from the {self.backend} output")
            findings.append(Finding(
                "gpu_lost", f"gpu:{state.index}", line,
                f"GPU {state.index} ({state.label}) was listed before and is gone: it fell off the bus or its "
                "driver lost it",
            ))  # fmt: skip
        return findings

    def _compare(self, state: _GpuState, reading: _GpuReading) -> list[Finding]:
        findings = []
        rises = []
        for name, value in reading.ecc.items():
            if value is None:
                continue
            before = state.ecc.get(name)
            state.ecc[name] = value
            # a first known value is a baseline; a drop is a reset (a driver reload clears volatile counts)
            if before is not None and value > before:
                rises.append((name, before, value))
        if rises:
            deltas = [value - before for _, before, value in rises]
            count = max(deltas) if reading.overlapping else sum(deltas)
            changes = ", ".join(f"{before} -> {value} ({name})" for name, before, value in rises)
            lines = dict.fromkeys(reading.evidence.get(name, "") for name, _, _ in rises)
            findings.append(Finding(
                "gpu_ecc", f"gpu:{state.index}", "; ".join(filter(None, lines)),
                f"uncorrectable ECC errors {changes}", count,
            ))  # fmt: skip
        pages = reading.retired_pages
        if pages is not None:
            before, state.retired_pages = state.retired_pages, pages
            if before is not None and pages > before:
                findings.append(Finding(
                    "gpu_ecc", f"gpu:{state.index}", reading.pages_evidence,
                    f"retired VRAM pages {before} -> {pages}", pages - before,
                ))  # fmt: skip
        return findings

    def _read(self) -> _GpuSnapshot:
        if self.backend == "nvidia-smi":
            return self._read_nvidia()
        if self.backend == "amd-smi":
            return self._read_amd_smi()
        return self._read_sysfs()

    def _read_nvidia(self) -> _GpuSnapshot:
        argv = [*self.config.nvidia_smi, *NVIDIA_SMI_ARGS]
        out = run_command(argv, self.config.command_timeout_s)
        readings = {}
        for line in out.stdout.splitlines():
            fields = [part.strip() for part in line.split(",")]
            index = _counter(fields[0]) if len(fields) == 4 else None
            if index is None or index >= MAX_GPUS or (key := _bus_key(fields[1])) is None:
                continue
            # an NVML error in place of a value ("[GPU is lost]") means the GPU is listed but unreachable
            if any("lost" in value.lower() for value in fields[2:]):
                continue
            readings[key] = _GpuReading(
                index, clip(fields[1], 100), {"volatile": _smi_value(fields[2]), "aggregate": _smi_value(fields[3])},
                overlapping=True, evidence={"volatile": clip(line.strip()), "aggregate": clip(line.strip())},
            )  # fmt: skip
        text = out.stdout + "\n" + out.stderr
        mentions = {}
        for line in text.splitlines():
            key = _bus_key(line)
            if key is not None and key not in readings:
                mentions[key] = clip(line.strip())
        if "No devices were found" in text:
            return _GpuSnapshot({}, complete=True, mentions=mentions)
        if out.returncode != 0:
            # nvidia-smi exits non-zero when one GPU cannot be queried yet still lists the others: GPUs missing
            # from the rows are judged lost only when its messages name them
            error = f"{argv[0]} exited with status {out.returncode}: {out.first_line()}"
            if not readings and not mentions:
                raise ReadError(error)
            return _GpuSnapshot(readings, complete=False, mentions=mentions, error=error)
        if not readings:
            raise ReadError(f"{argv[0]}: unexpected output: {out.first_line()}")
        return _GpuSnapshot(readings, complete=True, mentions=mentions)

    def _read_amd_smi(self) -> _GpuSnapshot:
        argv = [*self.config.amd_smi, *AMD_SMI_ARGS]
        out = run_command(argv, self.config.command_timeout_s)
        if out.returncode != 0:
            raise ReadError(f"{argv[0]} exited with status {out.returncode}: {out.first_line()}")
        # a warning (a missing group membership, say) may come before the JSON
        start = min((i for i in (out.stdout.find("["), out.stdout.find("{")) if i >= 0), default=-1)
        if start < 0:
            raise ReadError(f"{argv[0]}: output is not JSON: {out.first_line()[:80]!r}")
        try:
            data, _ = json.JSONDecoder().raw_decode(out.stdout[start:])
        except json.JSONDecodeError as exc:
            raise ReadError(f"{argv[0]}: output is not JSON ({exc})") from None
        except RecursionError:
            raise ReadError(f"{argv[0]}: output is JSON nested too deep") from None
        if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
            data = data["gpu_data"]
        if not isinstance(data, list):
            raise ReadError(f"{argv[0]}: expected a JSON list of GPUs, got {out.first_line()[:80]!r}")
        readings = {}
        for entry in data:
            if not isinstance(entry, dict) or not is_int(entry.get("gpu")) or not 0 <= entry["gpu"] < MAX_GPUS:
                continue
            index = entry["gpu"]
            ecc = entry.get("ecc")
            count = _json_count(ecc.get("total_uncorrectable_count")) if isinstance(ecc, dict) else None
            readings[str(index)] = _GpuReading(
                index, f"gpu {index}", {"total": count}, overlapping=True,
                evidence={"total": clip(f"gpu {index}: ecc {json.dumps(ecc)}")},
            )  # fmt: skip
        return _GpuSnapshot(readings, complete=True)

    def _read_sysfs(self) -> _GpuSnapshot:
        drm = self._root / "sys/class/drm"
        if not drm.is_dir():
            raise ReadError(f"{drm}: no such directory")
        errors = []
        readings = {}
        for position, card in enumerate(_ras_cards(drm)):
            ras = card / "device/ras"
            ecc: dict[str, int | None] = {}
            evidence = {}
            for path in sorted(ras.glob("*_err_count")):
                block = path.name.removesuffix("_err_count")
                try:
                    text = read_text(path)
                except ReadError as exc:
                    errors.append(str(exc))
                    text = None
                ecc[block] = _ras_ue(text)
                if text is not None:
                    evidence[block] = f"{shown(self._root, path)}: {' '.join(text.split())}"
            pages_path = ras / "gpu_vram_bad_pages"
            try:
                pages = _retired_pages(read_text(pages_path))
            except ReadError:
                pages = None  # readable by root only on some kernels; the counters above still tell
            readings[card.name] = _GpuReading(
                position, shown(self._root, ras), ecc, overlapping=False, evidence=evidence,
                retired_pages=pages, pages_evidence=f"{shown(self._root, pages_path)}: {pages} pages retired",
            )  # fmt: skip
        return _GpuSnapshot(readings, complete=True, error="; ".join(errors) or None)


def _known(counters: dict[str, int | None]) -> dict[str, int]:
    return {name: value for name, value in counters.items() if value is not None}


def _ras_cards(drm: Path) -> list[Path]:
    """The cards with amdgpu RAS counters, in numeric order (card2 before card10); connectors are skipped."""
    cards = [path for path in drm.glob("card*") if re.fullmatch(r"card\d+", path.name)]
    return sorted((path for path in cards if (path / "device/ras").is_dir()), key=lambda path: int(path.name[4:]))


def _ras_ue(text: str | None) -> int | None:
    """The uncorrectable count of an amdgpu `*_err_count` file ("ue: 0", "ce: 3" and, on newer kernels, "de: 0")."""
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "ue":
            return _counter(value)
    return None


def _retired_pages(text: str | None) -> int | None:
    """How many pages `gpu_vram_bad_pages` lists as retired ("pfn : size : R"; P is pending, F failed)."""
    if text is None:
        return None
    return sum(1 for line in text.splitlines() if line.rpartition(":")[2].strip() == "R")


def gpu_backend(config: ProbeConfig) -> str:
    """The GPU backend `config.gpu` resolves to: nvidia-smi, amd-smi, sysfs or none.

    An explicit choice that cannot work here (its command not on PATH, no RAS counters) is a `ZayaError`."""
    choice = config.gpu
    has_ras = bool(_ras_cards(Path(config.root) / "sys/class/drm"))
    if choice == "auto":
        if shutil.which(config.nvidia_smi[0]):
            return "nvidia-smi"
        if shutil.which(config.amd_smi[0]):
            return "amd-smi"
        return "sysfs" if has_ras else "none"
    if choice in ("nvidia-smi", "amd-smi"):
        command = config.nvidia_smi if choice == "nvidia-smi" else config.amd_smi
        if not shutil.which(command[0]):
            raise ZayaError(f"probes.gpu is '{choice}' but the command '{command[0]}' was not found")
        return choice
    if choice in ("sysfs", "rocm-smi"):
        if not has_ras:
            raise ZayaError(
                f"probes.gpu is '{choice}' but no card under {Path(config.root) / 'sys/class/drm'} has amdgpu RAS "
                "counters (device/ras)"
            )
        return "sysfs"
    return "none"

