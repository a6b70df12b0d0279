"""The `[probes]` table of a policy file: what the supervisor's probes watch and how they read it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zaya.errors import ZayaError
from zaya.resilience.readings import is_int
from zaya.schema import shown

GIB = 2**30
GPU_BACKENDS = ("auto", "nvidia-smi", "amd-smi", "rocm-smi", "sysfs", "none")
MAX_SECONDS = 1e7  # any timeout: about 116 days, and within what every clock and timer of the OS takes
MAX_ITEMS = 4096  # entries of a list (a command's arguments, interfaces, directories)
MAX_TEXT = 4096  # characters of one string (a path, an argument)

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_strings(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_ITEMS and all(
        isinstance(item, str) and len(item) <= MAX_TEXT for item in value)


# every ProbeConfig field: a test of its value and what the value must be
_CHECKS = {
    "root": (lambda v: isinstance(v, str) and 0 < len(v) <= MAX_TEXT, "a non-empty string (a path)"),
    "gpu": (lambda v: isinstance(v, str) and v in GPU_BACKENDS, f"one of {', '.join(GPU_BACKENDS)}"),
    "nvidia_smi": (lambda v: _is_strings(v) and len(v) > 0 and v[0] != "",
                   "a non-empty list of strings (the command)"),
    "amd_smi": (lambda v: _is_strings(v) and len(v) > 0 and v[0] != "", "a non-empty list of strings (the command)"),
    "nics": (_is_strings, f"a list of strings (at most {MAX_ITEMS:,})"),
    "storage": (_is_strings, f"a list of strings (at most {MAX_ITEMS:,})"),
    "min_free_bytes": (lambda v: is_int(v) and 0 <= v < 2**63, "a non-negative integer (below 2**63)"),
    "command_timeout_s": (lambda v: _is_number(v) and math.isfinite(v) and 0.01 <= v <= MAX_SECONDS,
                          f"a number of seconds in [0.01, {MAX_SECONDS:g}]"),
}


def _check_fields(values: dict[str, Any], where: str) -> None:
    for key, value in values.items():
        accepts, expected = _CHECKS[key]
        if not accepts(value):
            raise ZayaError(f"{where}: 'probes.{key}' must be {expected}, got {shown(value)}")
