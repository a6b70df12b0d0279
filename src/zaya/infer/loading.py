"""Models from disk: a Hugging Face directory (native or ZAYA1-base's legacy layout), one of our checkpoints, or a
run directory (its newest valid checkpoint), loaded into a `Zaya` without unpickling anything."""

from __future__ import annotations

from pathlib import Path

import torch

from zaya import checkpoint
from zaya.device import resolve_device
from zaya.model.config import ZayaConfig
from zaya.model.hf import TensorSource, load_hf_state
from zaya.model.transformer import Zaya
from zaya.weights import LayoutChoice, read_hf_config, resolve_model_dir


def empty_model(config: ZayaConfig, device: torch.device, dtype: torch.dtype) -> Zaya:
    """A model whose weights are allocated but not initialised (they are about to be loaded)."""
    with torch.device("meta"):
        model = Zaya(config)
    model.to_empty(device=device)
    model.to(dtype)
    model.restore_rope()  # non-persistent buffers: recomputed, not loaded
    return model


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
        stored = getattr(torch, info.get("dtype", "float32"))  # one of checkpoint.STORED_DTYPES, as read
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
