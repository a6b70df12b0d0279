"""The Python API for scripts and notebooks: build, load, convert and export models.

    model = zaya.build_model("tiny")                 # freshly initialised
    model = zaya.load_model("path/to/dir")           # an HF directory or one of our checkpoints
    logits = model(torch.tensor([[2, 17, 5]]))       # [B, T] ids -> [B, T, V] logits
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from zaya import checkpoint
from zaya.checkpoint.files import fresh_staging, fsync_dir
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.device import resolve_device
from zaya.errors import ZayaError
from zaya.infer.hf_files import present_hf_files, write_hf_files
from zaya.infer.loading import load_model
from zaya.model.config import ZayaConfig
from zaya.model.hf import native_config_json, save_hf_state
from zaya.model.presets import get_preset
from zaya.model.safetensors_files import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE
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
              source: Path | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write `model` as an HF-native directory that `transformers.AutoModelForCausalLM.from_pretrained` loads
    with no missing or unexpected keys: config.json, the weights and generation_config.json, and with a
    `tokenizer` (a tokenizer.json) also tokenizer.json, tokenizer_config.json and special_tokens_map.json, so
    that `AutoTokenizer`, pipelines and `lm_eval --model hf` load it as it is.

    The weights are stored in `dtype` (default: the model's), config.json saying so, as `model.safetensors`,
    or as shards of at most `max_shard_bytes` with `model.safetensors.index.json` when they are larger.

    `source` is the directory the model came from (a zaya checkpoint or an HF directory): the tokenizer and
    generation files it has are written unchanged, and a training checkpoint's sequence length and dataset
    end-of-document token inform those made here (`zaya.infer.hf_files`)."""
    directory = Path(directory)
    if dtype is not None and not dtype.is_floating_point:
        raise ZayaError(f"{directory}: an export's dtype must be a floating-point one, not {dtype}")
    tmp = fresh_staging(directory)
    try:
        # Routers keep their balancing biases in fp32; the HF layout stores every tensor in one dtype.
        dtype = dtype or model.embed.weight.dtype
        save_hf_state(tmp, model.state_dict(), model.config, layout="native", dtype=dtype,
                      max_shard_bytes=max_shard_bytes)
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


def convert(src: str | Path, dst: str | Path, *, layout: LayoutChoice = "auto", dtype: torch.dtype | None = None,
            max_shard_bytes: int | None = None, overwrite: bool = False) -> str:
    """Convert between an HF directory and our checkpoint format; the direction follows from `src`.

    The tokenizer and its HF files (tokenizer_config.json, special_tokens_map.json, generation_config.json)
    travel with the weights both ways. `dtype` and `max_shard_bytes` shape an export (zaya->hf, see
    `export_hf`); a checkpoint keeps the dtype of its HF source. `overwrite` replaces an existing `dst` that is
    an HF directory or a zaya checkpoint: the new one is written beside it first, so a failure leaves the old
    one as it was. Returns "hf->zaya" or "zaya->hf".
    """
    src, kind = resolve_model_dir(src)
    dst = Path(dst)
    if kind == "hf" and (dtype is not None or max_shard_bytes is not None):
        raise ZayaError(f"{src}: a dtype and a max shard size (--dtype, --max-shard-size) are for exports "
                        "(zaya->hf); a zaya checkpoint keeps the dtype of its Hugging Face source")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise ZayaError(f"{dst}: already exists; refusing to overwrite (--overwrite replaces an earlier export)")
        _check_replaceable(dst, src)
    model = load_model(src, device="cpu", layout=layout)
    tokenizer = src / TOKENIZER_FILE
    if kind == "hf":
        extra = [tokenizer] if tokenizer.is_file() else []
        _write_in_place_of(dst, lambda out: checkpoint.save_model_checkpoint(
            out, model, model.config, extra_files=extra + present_hf_files(src)))
        return "hf->zaya"
    _write_in_place_of(dst, lambda out: export_hf(
        model, out, tokenizer=tokenizer, source=src, dtype=dtype,
        max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes))
    return "zaya->hf"


def _check_replaceable(dst: Path, src: Path) -> None:
    """Refuse to replace anything but an earlier conversion's output: --overwrite deletes what it replaces."""
    if not dst.is_dir():
        raise ZayaError(f"{dst}: not a directory; --overwrite replaces only an HF export or a zaya checkpoint")
    target, source = dst.resolve(), src.resolve()
    if target == source or target in source.parents:
        raise ZayaError(f"{dst}: holds the source {src}; --overwrite would delete what it converts")
    hf = (dst / "config.json").is_file() and (
        (dst / SINGLE_FILE).is_file() or (dst / INDEX_FILE).is_file() or any(dst.glob("*.safetensors")))
    if not (hf or checkpoint.is_checkpoint(dst)):
        raise ZayaError(f"{dst}: neither an HF export nor a zaya checkpoint; --overwrite replaces only those")


def _write_in_place_of(dst: Path, write) -> None:
    """`write(path)` makes a whole directory at `path`; an existing `dst` is replaced by it only once it is
    complete, so a failure leaves `dst` as it was."""
    if not (dst.exists() or dst.is_symlink()):
        write(dst)
        return
    # a hidden sibling on the same filesystem, so that both moves are renames
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        write(staging / dst.name)
        os.rename(dst, staging / "replaced")
        try:
            os.rename(staging / dst.name, dst)
        except BaseException:
            os.rename(staging / "replaced", dst)
            raise
        fsync_dir(dst.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
