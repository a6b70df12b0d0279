"""Tensors in and out of a checkpoint directory through `torch.distributed.checkpoint`: every rank reads and writes
its own shards, names and shapes are checked before a load, and the `.metadata` that DCP pickles is read by the
safe reader of `zaya.checkpoint.files`. Also the model-only checkpoints of `zaya convert`, and each rank's
random-number-generator states as JSON.
"""

from __future__ import annotations

import base64
import random
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from zaya.checkpoint.files import (
    FORMAT,
    INFO_FILE,
    MODEL_VERSIONS,
    VERSION,
    SafeReader,
    copy_input,
    named_as,
    output_exists,
    plain_storage_error,
    read_json,
    read_metadata,
    write_json,
    write_manifest,
)
from zaya.device import accelerator_rng_states, set_accelerator_rng_states
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.owned import Staging, remove_stale_staging
from zaya.schema import Fields

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
    fields = Fields(info, path)
    fields.str("format", choices=(FORMAT,))
    version = fields.int("version")
    if version not in MODEL_VERSIONS:
        raise ZayaError(f"{path}: unsupported checkpoint version {version!r} (this build reads "
                        f"{', '.join(map(str, MODEL_VERSIONS))})")
    fields.str("dtype", None, choices=STORED_DTYPES)
    fields.int("step", None, lo=0)
    return ZayaConfig.from_dict(fields.dict("model"), source=f"{path}: model"), info


STORED_DTYPES = ("float32", "bfloat16", "float16", "float64")  # what a checkpoint's weights may be stored in


def _checkpoint_info(config: ZayaConfig, model: torch.nn.Module, world_size: int) -> dict:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"format": FORMAT, "version": VERSION, "model": config.to_dict(), "dtype": dtype, "world_size": world_size}


def save_model_checkpoint(
    directory: Path, model: torch.nn.Module, config: ZayaConfig, extra_files: Iterable[Path] = (), *,
    replace: bool = False, check_replaced: Callable[[Path], None] | None = None,
) -> None:
    """Write the model's weights as a complete single-process checkpoint at `directory`, atomically: made in a
    staging directory of this process's own (`zaya.owned.Staging`) and renamed into place, or removed on any
    failure (Ctrl-C and SIGTERM included). `extra_files` (a tokenizer, say) are copied in and covered by the
    manifest. An existing `directory` is refused, unless `replace`: the caller has proved it is zaya's output
    (`zaya.api.convert` does; `check_replaced(directory)` proves it again just before the swap). Errors name
    `directory`, never the staging path."""
    directory = Path(directory)
    if not replace and output_exists(directory):
        raise ZayaError(f"{directory}: already exists; refusing to overwrite")
    remove_stale_staging(directory, locked=False)  # what killed writers of the same output left
    with Staging(directory, "zaya checkpoint") as staging:
        out = staging.path
        with named_as(out, directory):
            out.mkdir()
            dcp_save({"model": model.state_dict()}, out)
            write_json(out / INFO_FILE, _checkpoint_info(config, model, world_size=1))
            for extra in extra_files:
                copy_input(extra, out)
            write_manifest(out, 0, [p.name for p in out.iterdir() if p.is_file()])
        if replace and check_replaced is not None and output_exists(directory):
            check_replaced(directory)
        staging.commit(replace=replace)


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
        try:
            dcp.load(state, storage_reader=SafeReader(str(directory)), process_group=process_group,
                     no_dist=alone(process_group))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException: a disk's error, in one line
            plain = plain_storage_error(exc)
            if plain is not None:
                raise plain from exc
            raise


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
                 process_group=process_group, no_dist=alone(process_group))


def alone(process_group=None) -> bool:
    """Whether DCP has only this process to coordinate over `process_group` (None: the default group, if any);
    it is then told so (`no_dist`), and skips its collectives, which write the same files.

    Those collectives are not free even on one rank: gloo runs them in its own threads, and the pickled save or
    load plans they copy there (tens of KB for a training state) are large enough for ATen to copy them with an
    OpenMP team of that thread. The team lives as long as the group, and libgomp, once it manages more threads
    than there are cores, stops spin-waiting at the barriers of every parallel region, the training thread's
    included: every step after the first save (or a resume's load) ran a quarter to a third slower on a
    2-core CPU (docs/speed.md#after-a-checkpoint)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1
