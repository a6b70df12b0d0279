"""The Python API for scripts and notebooks: build, load, convert and export models.

    model = zaya.build_model("tiny")                 # freshly initialised
    model = zaya.load_model("path/to/dir")           # an HF directory or one of our checkpoints
    logits = model(torch.tensor([[2, 17, 5]]))       # [B, T] ids -> [B, T, V] logits

An output directory (an export, a conversion) is made in a staging directory of this process's own beside it
(`zaya.owned.Staging`) and renamed into place when whole; Ctrl-C, SIGTERM or an error removes the staging and
nothing else. `overwrite` replaces only what can be proved to be an earlier output: a zaya checkpoint (its info
file says zaya's format) or an HF directory of a ZAYA model (config.json says so, beside safetensors files),
never a link; the new one is written first, so a failure leaves the old one as it was.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from zaya import checkpoint, reading
from zaya.checkpoint.files import copy_input, is_zaya_checkpoint, named_as, output_exists
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.device import resolve_device
from zaya.errors import ZayaError
from zaya.infer.hf_files import present_hf_files, write_hf_files
from zaya.infer.loading import load_model
from zaya.model.config import ZayaConfig
from zaya.model.hf import save_hf_state
from zaya.model.hf_config import native_config_json
from zaya.model.presets import get_preset
from zaya.model.safetensors_files import DEFAULT_MAX_SHARD_BYTES
from zaya.model.transformer import Zaya
from zaya.owned import Staging, remove_stale_staging
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
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False) -> None:
    """Write `model` as an HF-native directory that `transformers.AutoModelForCausalLM.from_pretrained` loads
    with no missing or unexpected keys: config.json, the weights and generation_config.json, and with a
    `tokenizer` (a tokenizer.json) also tokenizer.json, tokenizer_config.json and special_tokens_map.json, so
    that `AutoTokenizer`, pipelines and `lm_eval --model hf` load it as it is.

    The weights are stored in `dtype` (default: the model's), config.json saying so, as `model.safetensors`,
    or as shards of at most `max_shard_bytes` with `model.safetensors.index.json` when they are larger.

    `source` is the directory the model came from (a zaya checkpoint or an HF directory): the tokenizer and
    generation files it has are written unchanged, and a training checkpoint's sequence length and dataset
    end-of-document token inform those made here (`zaya.infer.hf_files`). An existing `directory` is refused,
    unless `overwrite` and it is an earlier export or a zaya checkpoint (see the module docstring)."""
    directory = Path(directory)
    if dtype is not None and not dtype.is_floating_point:
        raise ZayaError(f"{directory}: an export's dtype must be a floating-point one, not {dtype}")
    replace = _check_output(directory, source, overwrite)
    remove_stale_staging(directory, locked=False)  # what killed exports into the same place left
    with Staging(directory, "zaya export") as staging:
        out = staging.path
        with named_as(out, directory):
            out.mkdir()
            # Routers keep their balancing biases in fp32; the HF layout stores every tensor in one dtype.
            dtype = dtype or model.embed.weight.dtype
            save_hf_state(out, model.state_dict(), model.config, layout="native", dtype=dtype,
                          max_shard_bytes=max_shard_bytes)
            checkpoint.write_json(out / "config.json", native_config_json(model.config, dtype))
            copied = None
            if tokenizer is not None and os.path.lexists(tokenizer):
                copied = copy_input(Path(tokenizer), out, TOKENIZER_FILE)
            write_hf_files(out, model.config, copied, source=source)
        if replace and output_exists(directory):  # again, just before it goes: it may have changed meanwhile
            check_replaceable(directory, source)
        staging.commit(replace=replace)


def convert(src: str | Path, dst: str | Path, *, layout: LayoutChoice = "auto", dtype: torch.dtype | None = None,
            max_shard_bytes: int | None = None, overwrite: bool = False) -> str:
    """Convert between an HF directory and our checkpoint format; the direction follows from `src`.

    The tokenizer and its HF files (tokenizer_config.json, special_tokens_map.json, generation_config.json)
    travel with the weights both ways. `dtype` and `max_shard_bytes` shape an export (zaya->hf, see
    `export_hf`); a checkpoint keeps the dtype of its HF source. `overwrite` replaces an existing `dst` that is
    an HF directory of a ZAYA model or a zaya checkpoint: the new one is written beside it first, so a failure
    leaves the old one as it was. Returns "hf->zaya" or "zaya->hf".
    """
    src, kind = resolve_model_dir(src)
    dst = Path(dst)
    if kind == "hf" and (dtype is not None or max_shard_bytes is not None):
        raise ZayaError(f"{src}: a dtype and a max shard size (--dtype, --max-shard-size) are for exports "
                        "(zaya->hf); a zaya checkpoint keeps the dtype of its Hugging Face source")
    replace = _check_output(dst, src, overwrite)  # before the model is loaded: a refusal costs nothing
    model = load_model(src, device="cpu", layout=layout)
    tokenizer = src / TOKENIZER_FILE
    if kind == "hf":
        extra = [tokenizer] if os.path.lexists(tokenizer) else []
        checkpoint.save_model_checkpoint(dst, model, model.config, extra_files=extra + present_hf_files(src),
                                         replace=replace, check_replaced=lambda d: check_replaceable(d, src))
        return "hf->zaya"
    export_hf(model, dst, tokenizer=tokenizer, source=src, dtype=dtype, overwrite=overwrite,
              max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
    return "zaya->hf"


def _check_output(dst: Path, src: Path | None, overwrite: bool) -> bool:
    """Whether `dst` exists and is to be replaced; refuses one that exists without `overwrite`, or that is not
    zaya's to replace."""
    if not output_exists(dst):
        return False
    if not overwrite:
        raise ZayaError(f"{dst}: already exists; refusing to overwrite (--overwrite replaces an earlier export)")
    check_replaceable(dst, src)
    return True


def check_replaceable(dst: Path, src: Path | None = None) -> None:
    """Refuse to replace anything but an earlier conversion's output: --overwrite deletes what it replaces."""
    kinds = "--overwrite replaces only an HF export or a zaya checkpoint"
    mode = os.lstat(dst).st_mode
    if stat.S_ISLNK(mode):
        raise ZayaError(f"{dst}: a symbolic link; {kinds}, never a link")
    if not stat.S_ISDIR(mode):
        raise ZayaError(f"{dst}: not a directory; {kinds}")
    if src is not None:
        target, source = os.path.realpath(dst), os.path.realpath(src)
        if source == target or source.startswith(target.rstrip(os.sep) + os.sep):
            raise ZayaError(f"{dst}: holds the source {src}; --overwrite would delete what it converts")
    if not (is_zaya_checkpoint(dst) or is_zaya_hf_export(dst)):
        raise ZayaError(f"{dst}: neither an HF export nor a zaya checkpoint; {kinds}")


def is_zaya_hf_export(directory: Path) -> bool:
    """Whether `directory` (not a link) is an HF directory of a ZAYA model: a config.json (a regular file) whose
    model_type is "zaya", beside at least one safetensors file (a regular file)."""
    directory = Path(directory)
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return False
        config = reading.read_json(directory / "config.json", "config", follow_links=False)
        weights = [entry for entry in os.scandir(directory)
                   if entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False)]
    except (ZayaError, OSError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "zaya" and bool(weights)
