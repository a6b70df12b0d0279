"""The ZAYA1 model: CCGQA attention, the ZAYA1 router, dropless top-1 MoE, residual scaling."""

from zaya.model.config import ZayaConfig
from zaya.model.presets import get_preset, preset_names
from zaya.model.transformer import RouterStats, Zaya

__all__ = ["RouterStats", "Zaya", "ZayaConfig", "get_preset", "preset_names"]
