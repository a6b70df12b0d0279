"""Tensors in and out of a checkpoint directory through `torch.distributed.checkpoint`: every rank reads and writes
its own shards, names and shapes are checked before a load, and the `.metadata` that DCP pickles is read by the
safe reader of `zaya.checkpoint.files`. Also the model-only checkpoints of `zaya convert`, and each rank's
random-number-generator states as JSON.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from zaya.checkpoint.files import (
    FORMAT,
    INFO_FILE,
    MODEL_VERSIONS,
    VERSION,
    SafeReader,
    fresh_staging,
    fsync_dir,
    read_json,
    read_metadata,
    write_json,
    write_manifest,
)
from zaya.device import accelerator_rng_states, set_accelerator_rng_states
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig

# ---- random-number generators -------------------------------------------------------------------------


def rng_state() -> dict:
    """The torch (CPU and accelerator) and Python RNG states of this process, as JSON."""
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _python_random_state(random.getstate()),
    }
    accelerators = accelerator_rng_states()
    if accelerators:  # under the key "cuda" for either vendor, as written before
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in accelerators]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state:
        set_accelerator_rng_states(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _python_random_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


# ---- model-only checkpoints (`zaya convert`) ----------------------------------------------------------


def read_checkpoint_config(directory: Path) -> tuple[ZayaConfig, dict]:
    """The model config and the whole `zaya.json` of a checkpoint directory."""
    path = Path(directory) / INFO_FILE
    info = read_json(path)
    if info.get("format") != FORMAT:
        raise ZayaError(f"{path}: field 'format' must be '{FORMAT}'")
    if info.get("version") not in MODEL_VERSIONS:
        raise ZayaError(f"{path}: unsupported checkpoint version {info.get('version')!r} (this build reads "
                        f"{', '.join(map(str, MODEL_VERSIONS))})")
    return ZayaConfig.from_dict(info.get("model"), source=f"{path}: model"), info


def _checkpoint_info(config: ZayaConfig, model: torch.nn.Module, world_size: int) -> dict:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"format": FORMAT, "version": VERSION, "model": config.to_dict(), "dtype": dtype, "world_size": world_size}


def save_model_checkpoint(
    directory: Path, model: torch.nn.Module, config: ZayaConfig, extra_files: Iterable[Path] = ()
) -> None:
    """Write the model's weights as a complete single-process checkpoint into a fresh `directory`, atomically
    (via `directory.tmp`). `extra_files` (a tokenizer, say) are copied in and covered by the manifest."""
    directory = Path(directory)
    tmp = fresh_staging(directory)
    try:
        dcp_save({"model": model.state_dict()}, tmp)
        write_json(tmp / INFO_FILE, _checkpoint_info(config, model, world_size=1))
        for extra in extra_files:
            shutil.copyfile(extra, tmp / Path(extra).name)
        write_manifest(tmp, 0, [p.name for p in tmp.iterdir() if p.is_file()])
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model_weights(directory: Path, model: torch.nn.Module) -> None:
    """Fill `model` in place from the checkpoint's "model" entries, checking names and shapes first."""
    state = {"model": model.state_dict()}
    load_tensors(directory, state)
    model.load_state_dict(state["model"])


def load_tensors(directory: Path, state: dict, process_group=None) -> None:
    """DCP-load the tensors of `state` (nested dicts of tensors, DTensors included, filled in place),
    checking names and shapes first; in a multi-process job every rank calls it, with `process_group` for
    DCP's own collectives."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    flat = _flatten(state)
    missing = [key for key in flat if key not in metadata.state_dict_metadata]
    if missing:
        raise ZayaError(f"{directory}: checkpoint lacks tensor '{missing[0]}' ({len(missing)} missing in all)")
    for key, tensor in flat.items():
        stored = metadata.state_dict_metadata[key]
        if tuple(stored.size) != tuple(tensor.shape):
            raise ZayaError(f"{directory}: tensor '{key}' has shape {list(stored.size)}, expected {list(tensor.shape)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(str(directory)), process_group=process_group)


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def dcp_save(state: dict, directory: Path, process_group=None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
                 process_group=process_group)
