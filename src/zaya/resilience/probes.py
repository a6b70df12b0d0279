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

GpuProbe and its backends (nvidia-smi, amd-smi, amdgpu sysfs; `ProbeConfig.gpu` chooses) are in
`zaya.resilience.gpu_probe`.

A probe only reads: sysfs files under `ProbeConfig.root` (tests point it at a fake tree) and the output of the
GPU backends' read-only commands. A failing command or an unreadable file never raises out of `poll`: that
poll reports what it could (often nothing) and `last_error` says what went wrong.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from zaya.resilience.findings import Finding
from zaya.resilience.gpu_probe import GpuProbe, gpu_backend
from zaya.resilience.probe_config import GIB, ProbeConfig
from zaya.resilience.readings import ReadError, read_int, read_text, shown

# operstate values (RFC 2863) that mean the link carries no traffic; "unknown" and "dormant" are left out, as
# some drivers report them for healthy links
LINK_DOWN_STATES = frozenset({"down", "lowerlayerdown", "notpresent"})
ABSENT = "absent"  # the state of an interface or port whose sysfs directory is gone


class Probe(Protocol):
    """A detector the supervisor polls; `last_error` is why the latest poll could not read everything, or None."""

    name: str
    last_error: str | None

    def poll(self) -> list[Finding]:
        """Read the hardware once and return what changed since the previous poll."""


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
            operstate = read_text(operstate_path)
        except ReadError as exc:
            errors.append(str(exc))
            return []
        state = ABSENT if operstate is None else operstate.lower()
        down = state in LINK_DOWN_STATES or state == ABSENT
        link = self._links.get(name)
        if down and (link is None or not link.down):
            was = "at the first poll" if link is None else "after being up"
            if state == ABSENT:
                line = f"{shown(self._root, base)}: no such interface"
            else:
                line = f"{shown(self._root, operstate_path)}: {operstate}"
            findings.append(Finding("nic", f"nic:{name}", line, f"{name} is {state} {was}"))
        if link is None:
            link = self._links[name] = _LinkState(down)
        link.down = down
        changes_path = base / "carrier_changes"
        try:
            changes = read_int(changes_path)
        except ReadError as exc:
            errors.append(str(exc))
            changes = None
        if changes is None:
            return findings
        before, link.carrier_changes = link.carrier_changes, changes
        # a drop means the interface was recreated (a driver reload): the new count is the new baseline
        if before is not None and changes > before:
            link.flaps += changes - before
            findings.append(Finding(
                "nic_flap", f"nic:{name}", f"{shown(self._root, changes_path)}: {changes}",
                f"{name}'s carrier changed {changes - before} times since the previous poll, {link.flaps} since the "
                "probe started", link.flaps,
            ))  # fmt: skip
        return findings

    def _poll_port(self, port: str, errors: list[str]) -> list[Finding]:
        device, _, number = port.partition("/")
        base = self._ib / device / "ports" / number
        state_path = base / "state"
        try:
            text = read_text(state_path)  # "4: ACTIVE", "1: DOWN", "2: INIT", "3: ARMED"
        except ReadError as exc:
            errors.append(str(exc))
            return []
        state_name = ABSENT if text is None else text.rpartition(":")[2].strip().upper()
        active = state_name == "ACTIVE"
        known = self._ports.get(port)
        lines, details, count = [], [], 1
        if not active and (known is None or known.active):
            if text is None:
                lines.append(f"{shown(self._root, base)}: no such port")
            else:
                lines.append(f"{shown(self._root, state_path)}: {text}")
            was = "at the first poll" if known is None else "after being ACTIVE"
            details.append(f"{device} port {number} is {state_name} {was}")
        if known is None:
            known = self._ports[port] = _PortState(active)
        known.active = active
        downed_path = base / "counters/link_downed"
        try:
            downed = read_int(downed_path)
        except ReadError as exc:
            errors.append(str(exc))
            downed = None
        if downed is not None:
            before, known.link_downed = known.link_downed, downed
            # the counter is 8 bits wide and saturates; a drop means it was cleared, which starts a new baseline
            if before is not None and downed > before:
                count = downed - before
                lines.append(f"{shown(self._root, downed_path)}: {downed}")
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
