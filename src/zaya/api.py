"""The Python API for scripts and notebooks: build, load, convert and export models.

    model = zaya.build_model("tiny")                 # freshly initialised
    model = zaya.load_model("path/to/dir")           # an HF directory or one of our checkpoints
    logits = model(torch.tensor([[2, 17, 5]]))       # [B, T] ids -> [B, T, V] logits
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from zaya import checkpoint
from zaya.checkpoint.files import fresh_staging
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.device import resolve_device
from zaya.errors import ZayaError
from zaya.infer.hf_files import present_hf_files, write_hf_files
from zaya.infer.loading import load_model
from zaya.model.config import ZayaConfig
from zaya.model.hf import native_config_json, save_hf_state
from zaya.model.presets import get_preset
from zaya.model.transformer import Zaya
from zaya.weights import LayoutChoice, resolve_model_dir

__all__ = ["build_model", "convert", "export_hf", "load_model"]


def build_model(
    preset_or_config: str | ZayaConfig,
    *,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> Zaya:
    """A freshly initialised model from a preset name (`"tiny"`, `"zaya1-base"`, ...) or a `ZayaConfig`."""
    config = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    device = resolve_device(device)
    generator_state = torch.random.get_rng_state() if seed is not None else None
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = Zaya(config)
    finally:
        if generator_state is not None:
            torch.random.set_rng_state(generator_state)
    if dtype is not None:
        model.to(dtype)
    return model


def export_hf(model: Zaya, directory: str | Path, *, tokenizer: Path | None = None,
              source: Path | None = None) -> None:
    """Write `model` as an HF-native directory that `transformers.AutoModelForCausalLM.from_pretrained` loads
    with no missing or unexpected keys: config.json, model.safetensors and generation_config.json, and with a
    `tokenizer` (a tokenizer.json) also tokenizer.json, tokenizer_config.json and special_tokens_map.json, so
    that `AutoTokenizer`, pipelines and `lm_eval --model hf` load it as it is.

    `source` is the directory the model came from (a zaya checkpoint or an HF directory): the tokenizer and
    generation files it has are written unchanged, and a training checkpoint's sequence length and dataset
    end-of-document token inform those made here (`zaya.infer.hf_files`)."""
    directory = Path(directory)
    tmp = fresh_staging(directory)
    try:
        dtype = model.embed.weight.dtype
        # Routers keep their balancing biases in fp32; the HF layout stores every tensor in the model's dtype.
        state = {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}
        save_hf_state(tmp, state, model.config, layout="native")
        checkpoint.write_json(tmp / "config.json", native_config_json(model.config, dtype))
        copied = None
        if tokenizer is not None and Path(tokenizer).is_file():
            copied = tmp / TOKENIZER_FILE
            shutil.copyfile(tokenizer, copied)
        write_hf_files(tmp, model.config, copied, source=source)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert(src: str | Path, dst: str | Path, *, layout: LayoutChoice = "auto") -> str:
    """Convert between an HF directory and our checkpoint format; the direction follows from `src`.

    The tokenizer and its HF files (tokenizer_config.json, special_tokens_map.json, generation_config.json)
    travel with the weights both ways. Returns "hf->zaya" or "zaya->hf".
    """
    src, kind = resolve_model_dir(src)
    dst = Path(dst)
    if dst.exists():
        raise ZayaError(f"{dst}: already exists; refusing to overwrite")
    model = load_model(src, device="cpu", layout=layout)
    tokenizer = src / TOKENIZER_FILE
    if kind == "hf":
        extra = [tokenizer] if tokenizer.is_file() else []
        checkpoint.save_model_checkpoint(dst, model, model.config, extra_files=extra + present_hf_files(src))
        return "hf->zaya"
    export_hf(model, dst, tokenizer=tokenizer, source=src)
    return "zaya->hf"

