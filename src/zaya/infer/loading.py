"""Models from disk: a Hugging Face directory (native or ZAYA1-base's legacy layout), one of our checkpoints, or a
run directory (its newest valid checkpoint), loaded into a `Zaya` without unpickling anything."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from zaya import checkpoint
from zaya.device import resolve_device
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.hf import (
    TensorSource,
    config_from_legacy,
    config_from_native,
    detect_layout,
    load_hf_state,
    read_config_json,
)
from zaya.model.transformer import Zaya
from zaya.run_dir import CHECKPOINTS_DIR

LayoutChoice = Literal["auto", "native", "legacy"]


def empty_model(config: ZayaConfig, device: torch.device, dtype: torch.dtype) -> Zaya:
    """A model whose weights are allocated but not initialised (they are about to be loaded)."""
    with torch.device("meta"):
        model = Zaya(config)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary.set_base(config.rope_theta)  # a non-persistent buffer: recomputed, not loaded
    return model


def model_dir_kind(path: Path) -> str:
    """'checkpoint' (ours), 'run' (a run or checkpoints directory) or 'hf' (config.json + safetensors)."""
    if not path.exists():
        raise ZayaError(f"{path}: no such directory")
    if not path.is_dir():
        raise ZayaError(f"{path}: not a directory")
    if checkpoint.is_checkpoint(path):
        return "checkpoint"
    if (path / "config.json").exists():
        return "hf"
    if (path / checkpoint.INFO_FILE).exists():
        raise ZayaError(f"{path}: checkpoint has no {checkpoint.METADATA_FILE}")
    if (path / CHECKPOINTS_DIR).is_dir() or (path / checkpoint.LATEST_FILE).exists() or any(path.glob("step_*")):
        return "run"
    raise ZayaError(f"{path}: neither a Hugging Face directory (config.json) nor a zaya checkpoint or run")


def resolve_model_dir(path: str | Path) -> tuple[Path, str]:
    """(directory to load, 'checkpoint' or 'hf'): a run directory resolves to its newest valid checkpoint."""
    path = Path(path)
    kind = model_dir_kind(path)
    if kind == "run":
        return checkpoint.resolve_checkpoint(path), "checkpoint"
    return path, kind


def read_hf_config(path: Path, layout: LayoutChoice = "auto") -> tuple[ZayaConfig, str]:
    """The model config of an HF directory and its layout ('native' or 'legacy')."""
    source = path / "config.json"
    data = read_config_json(source)
    chosen = detect_layout(data) if layout == "auto" else layout
    config = config_from_legacy(data, source) if chosen == "legacy" else config_from_native(data, source)
    return config, chosen


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    *,
    layout: LayoutChoice = "auto",
) -> Zaya:
    """Load a model from an HF directory (native or legacy layout) or one of our checkpoint directories.

    `dtype=None` keeps the dtype the weights were stored in. The model is returned in eval mode.
    """
    path, kind = resolve_model_dir(path)
    device = resolve_device(device)
    if kind == "checkpoint":
        config, info = checkpoint.read_checkpoint_config(path)
        stored = getattr(torch, str(info.get("dtype", "float32")), torch.float32)
        model = empty_model(config, torch.device("cpu"), stored)
        checkpoint.load_model_weights(path, model)
    else:
        config, chosen = read_hf_config(path, layout)
        source_dtype = TensorSource(path).dtype()
        model = empty_model(config, torch.device("cpu"), source_dtype)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        state = load_hf_state(path, config, expected, chosen)
        model.load_state_dict(state)
    model.to(device=device, dtype=dtype)
    return model.eval()
