"""Hardware probes: what a supervisor polls (about once a second) to notice trouble on its node.

Each probe keeps the previous reading and reports changes as `Finding`s, so a poll that sees nothing new
returns an empty list:

    probe          signal     subject           when
    GpuProbe       gpu_ecc    gpu:I             an uncorrectable ECC counter rose since the previous reading
                                                (count: the new errors), or, through amdgpu sysfs, more VRAM
                                                pages were retired (count: the new pages)
                   gpu_lost   gpu:I             a GPU listed before is gone from the tool's answer
    NicProbe       nic        nic:IF            the interface went down (operstate down, lowerlayerdown,
                                                notpresent, or its sysfs directory vanished)
                   nic_flap   nic:IF            carrier_changes rose; count: the increase since the probe
                                                started, which the policy compares with its threshold
                   nic        ib:DEV/PORT       an InfiniBand port left ACTIVE, or its link_downed counter rose
    StorageProbe   disk_low   path:DIR          free space fell below `min_free_bytes`

The first poll is the baseline: counters read there are history and are not reported, while a state that is
already bad (a link down, a disk full) is. A state is reported once when it starts; it is reported again only
after it recovered and went bad again.

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

A probe only reads: sysfs files under `ProbeConfig.root` (tests point it at a fake tree) and the output of the
read-only commands above. A failing command or an unreadable file never raises out of `poll`: that poll reports
what it could (often nothing) and `last_error` says what went wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding

GIB = 2**30
GPU_BACKENDS = ("auto", "nvidia-smi", "amd-smi", "rocm-smi", "sysfs", "none")
NVIDIA_SMI_ARGS = [
    "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total",
    "--format=csv,noheader,nounits",
]
AMD_SMI_ARGS = ["metric", "--ecc", "--json"]
# operstate values (RFC 2863) that mean the link carries no traffic; "unknown" and "dormant" are left out, as
# some drivers report them for healthy links
LINK_DOWN_STATES = frozenset({"down", "lowerlayerdown", "notpresent"})
ABSENT = "absent"  # the state of an interface or port whose sysfs directory is gone


@dataclass
class ProbeConfig:
    """What the probes watch and how they read it (the `[probes]` table of a policy file)."""

    root: str = "/"  # prefix of every sysfs path; the storage directories are real paths, not under it
    gpu: str = "auto"  # one of GPU_BACKENDS
    nvidia_smi: list[str] = field(default_factory=lambda: ["nvidia-smi"])  # the command; NVIDIA_SMI_ARGS follow
    amd_smi: list[str] = field(default_factory=lambda: ["amd-smi"])  # the command; AMD_SMI_ARGS follow
    # Interfaces to watch: network interfaces (eth0, ib0), InfiniBand devices (mlx5_0: all their ports) or
    # ports (mlx5_0/1). Empty: every InfiniBand port and every network interface backed by a device (one with
    # a `device` link in sysfs), which leaves out lo, bridges, veth pairs, docker0 and the like; a bond or a
    # VLAN is watched only when named here.
    nics: list[str] = field(default_factory=list)
    storage: list[str] = field(default_factory=list)  # directories whose filesystem's free space is watched
    # Below this much free space a checkpoint save is at risk; the default leaves room for a small model's
    # checkpoint and the logs, a large run should set it above the size of one checkpoint.
    min_free_bytes: int = 10 * GIB
    command_timeout_s: float = 10.0

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> ProbeConfig:
        """Build from the `[probes]` table of the file `where`, refusing unknown keys and wrong types."""
        if not isinstance(data, dict):
            raise ZayaError(f"{where}: 'probes' must be a table, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_CHECKS))
        if unknown:
            raise ZayaError(f"{where}: unknown key 'probes.{unknown[0]}'")
        _check_fields(data, where)
        values = {key: list(value) if isinstance(value, list) else value for key, value in data.items()}
        if "command_timeout_s" in values:
            values["command_timeout_s"] = float(values["command_timeout_s"])
        return cls(**values)

    def validate(self, where: str = "probe config") -> None:
        """Refuse a field of the wrong type or out of range (a config built in code rather than from a file)."""
        _check_fields({key: getattr(self, key) for key in _CHECKS}, where)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# every ProbeConfig field: a test of its value and what the value must be
_CHECKS = {
    "root": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "gpu": (lambda v: isinstance(v, str) and v in GPU_BACKENDS, f"one of {', '.join(GPU_BACKENDS)}"),
    "nvidia_smi": (lambda v: _is_strings(v) and len(v) > 0, "a non-empty list of strings (the command)"),
    "amd_smi": (lambda v: _is_strings(v) and len(v) > 0, "a non-empty list of strings (the command)"),
    "nics": (_is_strings, "a list of strings"),
    "storage": (_is_strings, "a list of strings"),
    "min_free_bytes": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "command_timeout_s": (lambda v: _is_number(v) and v > 0, "a positive number"),
}


def _check_fields(values: dict[str, Any], where: str) -> None:
    for key, value in values.items():
        accepts, expected = _CHECKS[key]
        if not accepts(value):
            raise ZayaError(f"{where}: 'probes.{key}' must be {expected}, got {value!r}")


class Probe(Protocol):
    """A detector the supervisor polls; `last_error` is why the latest poll could not read everything, or None."""

    name: str
    last_error: str | None

    def poll(self) -> list[Finding]:
        """Read the hardware once and return what changed since the previous poll."""


# ---- reading ---------------------------------------------------------------------------------------------


class _ReadError(Exception):
    """A command or file could not be read; the poll records the message in `last_error`."""


def _shown(root: Path, path: Path) -> str:
    """`path` as it is on a real machine: without the root prefix, which only tests set."""
    try:
        return "/" + path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _read(path: Path) -> str | None:
    """The stripped text of a sysfs file, None when it does not exist; other errors raise `_ReadError`."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _ReadError(f"{path}: {exc.strerror or exc}") from None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise _ReadError(f"{path}: expected an integer, got {text[:40]!r}") from None


@dataclass
class _Output:
    returncode: int
    stdout: str
    stderr: str

    def first_line(self) -> str:
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if line.strip():
                return line.strip()
        return "no output"


def _run(argv: list[str], timeout_s: float) -> _Output:
    """Run a read-only command; `_ReadError` when it cannot start or runs past `timeout_s`.

    It runs in a session of its own so that a timeout kills everything it started: a wrapper script's child
    would otherwise keep the pipes open and hold the supervisor past the timeout."""
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        raise _ReadError(f"{argv[0]}: {exc.strerror or exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise _ReadError(f"{argv[0]}: no answer within {timeout_s:g} s") from None
    return _Output(proc.returncode, stdout, stderr)


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


def _smi_value(text: str) -> int | None:
    """A counter from nvidia-smi's CSV: "[N/A]", "[Not Supported]" and other bracketed notes are unknown."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def _json_count(value: Any) -> int | None:
    """A counter from amd-smi's JSON: an integer, or "N/A" when unsupported."""
    if _is_int(value):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
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
        except _ReadError as exc:
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
        out = _run(argv, self.config.command_timeout_s)
        readings = {}
        for line in out.stdout.splitlines():
            fields = [part.strip() for part in line.split(",")]
            if len(fields) != 4 or not fields[0].isdigit() or (key := _bus_key(fields[1])) is None:
                continue
            # an NVML error in place of a value ("[GPU is lost]") means the GPU is listed but unreachable
            if any("lost" in value.lower() for value in fields[2:]):
                continue
            readings[key] = _GpuReading(
                int(fields[0]), fields[1], {"volatile": _smi_value(fields[2]), "aggregate": _smi_value(fields[3])},
                overlapping=True, evidence={"volatile": line.strip(), "aggregate": line.strip()},
            )  # fmt: skip
        text = out.stdout + "\n" + out.stderr
        mentions = {}
        for line in text.splitlines():
            key = _bus_key(line)
            if key is not None and key not in readings:
                mentions[key] = line.strip()
        if "No devices were found" in text:
            return _GpuSnapshot({}, complete=True, mentions=mentions)
        if out.returncode != 0:
            # nvidia-smi exits non-zero when one GPU cannot be queried yet still lists the others: GPUs missing
            # from the rows are judged lost only when its messages name them
            error = f"{argv[0]} exited with status {out.returncode}: {out.first_line()}"
            if not readings and not mentions:
                raise _ReadError(error)
            return _GpuSnapshot(readings, complete=False, mentions=mentions, error=error)
        if not readings:
            raise _ReadError(f"{argv[0]}: unexpected output: {out.first_line()}")
        return _GpuSnapshot(readings, complete=True, mentions=mentions)

    def _read_amd_smi(self) -> _GpuSnapshot:
        argv = [*self.config.amd_smi, *AMD_SMI_ARGS]
        out = _run(argv, self.config.command_timeout_s)
        if out.returncode != 0:
            raise _ReadError(f"{argv[0]} exited with status {out.returncode}: {out.first_line()}")
        # a warning (a missing group membership, say) may come before the JSON
        start = min((i for i in (out.stdout.find("["), out.stdout.find("{")) if i >= 0), default=-1)
        if start < 0:
            raise _ReadError(f"{argv[0]}: output is not JSON: {out.first_line()[:80]!r}")
        try:
            data, _ = json.JSONDecoder().raw_decode(out.stdout[start:])
        except json.JSONDecodeError as exc:
            raise _ReadError(f"{argv[0]}: output is not JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
            data = data["gpu_data"]
        if not isinstance(data, list):
            raise _ReadError(f"{argv[0]}: expected a JSON list of GPUs, got {out.first_line()[:80]!r}")
        readings = {}
        for entry in data:
            if not isinstance(entry, dict) or not _is_int(entry.get("gpu")):
                continue
            index = entry["gpu"]
            ecc = entry.get("ecc")
            count = _json_count(ecc.get("total_uncorrectable_count")) if isinstance(ecc, dict) else None
            readings[str(index)] = _GpuReading(
                index, f"gpu {index}", {"total": count}, overlapping=True,
                evidence={"total": f"gpu {index}: ecc {json.dumps(ecc)}"},
            )  # fmt: skip
        return _GpuSnapshot(readings, complete=True)

    def _read_sysfs(self) -> _GpuSnapshot:
        drm = self._root / "sys/class/drm"
        if not drm.is_dir():
            raise _ReadError(f"{drm}: no such directory")
        errors = []
        readings = {}
        for position, card in enumerate(_ras_cards(drm)):
            ras = card / "device/ras"
            ecc: dict[str, int | None] = {}
            evidence = {}
            for path in sorted(ras.glob("*_err_count")):
                block = path.name.removesuffix("_err_count")
                try:
                    text = _read(path)
                except _ReadError as exc:
                    errors.append(str(exc))
                    text = None
                ecc[block] = _ras_ue(text)
                if text is not None:
                    evidence[block] = f"{_shown(self._root, path)}: {' '.join(text.split())}"
            pages_path = ras / "gpu_vram_bad_pages"
            try:
                pages = _retired_pages(_read(pages_path))
            except _ReadError:
                pages = None  # readable by root only on some kernels; the counters above still tell
            readings[card.name] = _GpuReading(
                position, _shown(self._root, ras), ecc, overlapping=False, evidence=evidence,
                retired_pages=pages, pages_evidence=f"{_shown(self._root, pages_path)}: {pages} pages retired",
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
        if key.strip() == "ue" and value.strip().isdigit():
            return int(value)
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


# ---- network ---------------------------------------------------------------------------------------------


@dataclass
class _LinkState:
    down: bool
    carrier_changes: int | None = None
    flaps: int = 0  # carrier changes since the probe started


@dataclass
class _PortState:
    active: bool
    link_downed: int | None = None


class NicProbe:
    """Network interfaces going down or flapping, and InfiniBand ports leaving ACTIVE."""

    name = "nic"

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.last_error: str | None = None
        self._root = Path(config.root)
        self._net = self._root / "sys/class/net"
        self._ib = self._root / "sys/class/infiniband"
        self._links: dict[str, _LinkState] = {}
        self._ports: dict[str, _PortState] = {}

    def poll(self) -> list[Finding]:
        """Read every watched interface and port once; report links that went down and counters that rose."""
        errors: list[str] = []
        findings: list[Finding] = []
        interfaces, ports = self._watched()
        for name in interfaces:
            findings += self._poll_link(name, errors)
        for port in ports:
            findings += self._poll_port(port, errors)
        self.last_error = "; ".join(errors) or None
        return findings

    def _watched(self) -> tuple[list[str], list[str]]:
        """The interfaces and ports to read: the configured ones, or what sysfs shows plus what it showed before
        (one that vanished is reported, not forgotten)."""
        if self.config.nics:
            interfaces, ports = [], []
            for name in self.config.nics:
                if "/" in name:
                    ports.append(name)
                elif (self._ib / name).is_dir():
                    ports += self._ib_ports(name)
                else:
                    interfaces.append(name)
            known = {port for port in self._ports if port.split("/")[0] in self.config.nics}
            return interfaces, sorted(set(ports) | known, key=_port_order)
        interfaces = []
        if self._net.is_dir():
            interfaces = [path.name for path in self._net.iterdir() if path.name != "lo" and (path / "device").exists()]
        ports = []
        if self._ib.is_dir():
            for device in self._ib.iterdir():
                ports += self._ib_ports(device.name)
        return sorted(set(interfaces) | set(self._links)), sorted(set(ports) | set(self._ports), key=_port_order)

    def _ib_ports(self, device: str) -> list[str]:
        ports = self._ib / device / "ports"
        return [f"{device}/{path.name}" for path in ports.iterdir() if path.name.isdigit()] if ports.is_dir() else []

    def _poll_link(self, name: str, errors: list[str]) -> list[Finding]:
        findings = []
        base = self._net / name
        operstate_path = base / "operstate"
        try:
            operstate = _read(operstate_path)
        except _ReadError as exc:
            errors.append(str(exc))
            return []
        state = ABSENT if operstate is None else operstate.lower()
        down = state in LINK_DOWN_STATES or state == ABSENT
        link = self._links.get(name)
        if down and (link is None or not link.down):
            was = "at the first poll" if link is None else "after being up"
            if state == ABSENT:
                line = f"{_shown(self._root, base)}: no such interface"
            else:
                line = f"{_shown(self._root, operstate_path)}: {operstate}"
            findings.append(Finding("nic", f"nic:{name}", line, f"{name} is {state} {was}"))
        if link is None:
            link = self._links[name] = _LinkState(down)
        link.down = down
        changes_path = base / "carrier_changes"
        try:
            changes = _read_int(changes_path)
        except _ReadError as exc:
            errors.append(str(exc))
            changes = None
        if changes is None:
            return findings
        before, link.carrier_changes = link.carrier_changes, changes
        # a drop means the interface was recreated (a driver reload): the new count is the new baseline
        if before is not None and changes > before:
            link.flaps += changes - before
            findings.append(Finding(
                "nic_flap", f"nic:{name}", f"{_shown(self._root, changes_path)}: {changes}",
                f"{name}'s carrier changed {changes - before} times since the previous poll, {link.flaps} since the "
                "probe started", link.flaps,
            ))  # fmt: skip
        return findings

    def _poll_port(self, port: str, errors: list[str]) -> list[Finding]:
        device, _, number = port.partition("/")
        base = self._ib / device / "ports" / number
        state_path = base / "state"
        try:
            text = _read(state_path)  # "4: ACTIVE", "1: DOWN", "2: INIT", "3: ARMED"
        except _ReadError as exc:
            errors.append(str(exc))
            return []
        state_name = ABSENT if text is None else text.rpartition(":")[2].strip().upper()
        active = state_name == "ACTIVE"
        known = self._ports.get(port)
        lines, details, count = [], [], 1
        if not active and (known is None or known.active):
            if text is None:
                lines.append(f"{_shown(self._root, base)}: no such port")
            else:
                lines.append(f"{_shown(self._root, state_path)}: {text}")
            was = "at the first poll" if known is None else "after being ACTIVE"
            details.append(f"{device} port {number} is {state_name} {was}")
        if known is None:
            known = self._ports[port] = _PortState(active)
        known.active = active
        downed_path = base / "counters/link_downed"
        try:
            downed = _read_int(downed_path)
        except _ReadError as exc:
            errors.append(str(exc))
            downed = None
        if downed is not None:
            before, known.link_downed = known.link_downed, downed
            # the counter is 8 bits wide and saturates; a drop means it was cleared, which starts a new baseline
            if before is not None and downed > before:
                count = downed - before
                lines.append(f"{_shown(self._root, downed_path)}: {downed}")
                details.append(f"{device} port {number}'s link went down {count} times since the previous poll")
        if not lines:
            return []
        return [Finding("nic", f"ib:{port}", "; ".join(lines), "; ".join(details), count)]


def _port_order(port: str) -> tuple[str, int]:
    device, _, number = port.partition("/")
    return device, int(number) if number.isdigit() else -1


# ---- storage ---------------------------------------------------------------------------------------------


class StorageProbe:
    """Free space on the filesystems of the watched directories (the checkpoint directory)."""

    name = "storage"

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.last_error: str | None = None
        self._low: dict[str, bool] = {}

    def poll(self) -> list[Finding]:
        """Measure each directory's free space once; report the ones that just fell below the threshold."""
        threshold = self.config.min_free_bytes
        errors, findings = [], []
        for directory in self.config.storage:
            path = Path(os.path.abspath(directory))
            measured = _existing_ancestor(path)
            try:
                free = shutil.disk_usage(measured).free
            except OSError as exc:
                errors.append(f"{directory}: {exc.strerror or exc}")
                continue
            low = free < threshold
            if low and not self._low.get(directory, False):
                where = "" if measured == path else f" (measured on {measured}, its nearest existing parent)"
                findings.append(Finding(
                    "disk_low", f"path:{directory}", f"free {_gib(free)} < {_gib(threshold)} on {directory}",
                    f"{directory} has {_gib(free)} free{where}, below probes.min_free_bytes ({_gib(threshold)})",
                ))  # fmt: skip
            self._low[directory] = low
        self.last_error = "; ".join(errors) or None
        return findings


def _existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest existing parent: a checkpoint directory not made yet lands on that filesystem."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"


# ---- assembly --------------------------------------------------------------------------------------------


def build_probes(config: ProbeConfig) -> list[Probe]:
    """The probes `config` asks for: the GPU probe (unless its backend resolves to none), the NIC probe, and the
    storage probe when directories are named. A GPU backend chosen explicitly that cannot work is a `ZayaError`."""
    config.validate()
    probes: list[Probe] = []
    backend = gpu_backend(config)
    if backend != "none":
        probes.append(GpuProbe(config, backend))
    probes.append(NicProbe(config))
    if config.storage:
        probes.append(StorageProbe(config))
    return probes
