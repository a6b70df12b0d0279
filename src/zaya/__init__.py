"""zaya: an open training stack for ZAYA1-style Mixture-of-Experts language models."""

from zaya.api import build_model, convert, export_hf, load_model
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import get_preset
from zaya.model.transformer import Zaya

__all__ = ["Zaya", "ZayaConfig", "ZayaError", "build_model", "convert", "export_hf", "get_preset", "load_model"]
__version__ = "0.1.0"
