"""zaya: an open training stack for ZAYA1-style Mixture-of-Experts language models.

The Python API (`zaya.build_model`, `zaya.load_model`, ...) is imported on first use, so that the `zaya` command
starts without loading torch for what needs none (`zaya --help`, `zaya --version`, `zaya diagnose`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zaya.api import build_model, convert, export_hf, load_model
    from zaya.errors import ZayaError
    from zaya.model.config import ZayaConfig
    from zaya.model.presets import get_preset
    from zaya.model.transformer import Zaya

__version__ = "0.1.0"
_EXPORTS = {"build_model": "zaya.api", "convert": "zaya.api", "export_hf": "zaya.api", "load_model": "zaya.api",
            "ZayaError": "zaya.errors", "ZayaConfig": "zaya.model.config", "get_preset": "zaya.model.presets",
            "Zaya": "zaya.model.transformer"}
__all__ = ["Zaya", "ZayaConfig", "ZayaError", "build_model", "convert", "export_hf", "get_preset", "load_model"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zaya' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
