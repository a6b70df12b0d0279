"""Everything that depends on the accelerator vendor lives here, so no other module checks for one.

ROCm builds of PyTorch expose AMD GPUs through the `torch.cuda` namespace, so "cuda" below means either vendor.
"""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """The accelerator if one is visible (CUDA or ROCm), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` means the default device; strings such as "cpu" or "cuda:1" are parsed."""
    return default_device() if device is None else torch.device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (a no-op on the CPU); benchmarks call this around timed regions."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vendor(device: torch.device) -> str:
    """'amd', 'nvidia' or 'cpu': for logs and peak-FLOP tables, never for choosing code paths."""
    if device.type != "cuda":
        return "cpu"
    return "amd" if torch.version.hip else "nvidia"


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast is running in on `device`, or None when autocast is off."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None
