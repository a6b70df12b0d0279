"""Where a model's weights come from: a Hugging Face directory (native or ZAYA1-base's legacy layout), one of our
checkpoints, or a run directory (its newest valid checkpoint). `WeightSource` says which, with the model config it
was saved with, checks that it fits another config, fingerprints its contents, names the tokenizer it carries, and
loads its tensors into a model however that model is sharded. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from zaya import checkpoint, reading
from zaya.data.tokenizer import find_tokenizer
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.hf import load_hf_state, safetensors_files
from zaya.model.hf_config import config_from_legacy, config_from_native, detect_layout, read_config_json
from zaya.model.transformer import Zaya
from zaya.parallel.experts import ExpertViews
from zaya.run_dir import CHECKPOINTS_DIR

LayoutChoice = Literal["auto", "native", "legacy"]

# the fields that set the tensors' shapes: a source must agree on every one
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "moe_intermediate_size", "router_hidden_size", "cca_time0", "cca_time1")
# the fields that change what the same tensors compute: a difference is allowed (a longer context's RoPE base,
# say) and said
FUNCTION_FIELDS = ("partial_rotary_factor", "rope_theta", "rms_norm_eps", "skip_route", "layer_types", "sliding_window",
                   "sliding_rope_theta", "sliding_partial_rotary_factor")
_HASH_CHUNK = 1 << 22


def _function(config: ZayaConfig, name: str):
    """A function field as the blocks use it: no list of types and a list of "hybrid" only are the same model (an
    HF config.json always lists the types), and the sliding fields of a model without sliding blocks are none."""
    if name == "layer_types":
        return [config.layer_type(i) for i in range(config.num_hidden_layers)]
    return None if name.startswith("sliding_") and not config.sliding_blocks else getattr(config, name)


def model_dir_kind(path: Path) -> str:
    """'checkpoint' (ours), 'run' (a run or checkpoints directory) or 'hf' (config.json + safetensors)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ZayaError(f"{path}: no such directory") from None
    except OSError as exc:  # a loop of links, a name too long, no permission
        raise ZayaError(f"{path}: cannot read ({reading.os_reason(exc)})") from None
    except ValueError:
        raise ZayaError(f"{path}: not a usable path (a NUL character)") from None
    if not stat.S_ISDIR(mode):
        raise ZayaError(f"{path}: not a directory")
    if checkpoint.is_checkpoint(path):
        return "checkpoint"
    if os.path.lexists(path / "config.json"):
        return "hf"
    if os.path.lexists(path / checkpoint.INFO_FILE):
        raise ZayaError(f"{path}: checkpoint has no {checkpoint.METADATA_FILE}")
    if (path / CHECKPOINTS_DIR).is_dir() or os.path.lexists(path / checkpoint.LATEST_FILE) or any(
            path.glob("step_*")):
        return "run"
    raise ZayaError(f"{path}: neither a Hugging Face directory (config.json) nor a zaya checkpoint or run")


def resolve_model_dir(path: str | Path) -> tuple[Path, str]:
    """(directory to load, 'checkpoint' or 'hf'): a run directory resolves to its newest valid checkpoint, a
    checkpoint is verified against its manifests (a damaged one raises `ZayaError` naming the file)."""
    path = Path(path)
    kind = model_dir_kind(path)
    if kind in ("run", "checkpoint"):
        return checkpoint.resolve_checkpoint(path), "checkpoint"
    return path, kind


def read_hf_config(path: Path, layout: LayoutChoice = "auto") -> tuple[ZayaConfig, str]:
    """The model config of an HF directory and its layout ('native' or 'legacy')."""
    source = path / "config.json"
    data = read_config_json(source)
    chosen = detect_layout(data) if layout == "auto" else layout
    config = config_from_legacy(data, source) if chosen == "legacy" else config_from_native(data, source)
    return config, chosen


@dataclass(frozen=True)
class WeightSource:
    """A directory of weights, resolved: `path` is what is read (a run's newest valid checkpoint), `kind`
    'checkpoint' or 'hf', `layout` an HF directory's ('native' or 'legacy'), `step` a training checkpoint's."""

    path: Path
    kind: str
    layout: str
    config: ZayaConfig
    step: int | None = None

    @classmethod
    def open(cls, path: str | Path, layout: LayoutChoice = "auto") -> WeightSource:
        directory, kind = resolve_model_dir(path)
        if kind == "checkpoint":
            config, info = checkpoint.read_checkpoint_config(directory)  # its fields checked, the step's too
            return cls(directory, kind, "", config, info.get("step"))
        config, chosen = read_hf_config(directory, layout)
        return cls(directory, kind, chosen, config)

    @property
    def tokenizer(self) -> Path | None:
        """The tokenizer.json the weights carry (a checkpoint's copy of its data's, an export's), if any."""
        return find_tokenizer(self.path)

    def describe(self) -> str:
        if self.kind == "hf":
            return f"{self.path} (Hugging Face, {self.layout} layout)"
        return f"{self.path} (zaya checkpoint{f', step {self.step}' if self.step is not None else ''})"

    def check_fits(self, config: ZayaConfig, key: str) -> list[str]:
        """Refuse, in one line naming `key` and the fields, a source whose tensors differ in shape from those of a
        model of `config`; returns a note for each field that differs without changing a shape."""
        differ = [name for name in SHAPE_FIELDS if getattr(self.config, name) != getattr(config, name)]
        if differ:
            shown = ", ".join(f"model.{name} = {getattr(self.config, name)} there, {getattr(config, name)} here"
                              for name in differ)
            raise ZayaError(f"{key}: {self.path} holds a model of another shape ({shown})")
        return [f"{key}: model.{name} is {_function(self.config, name)} in {self.path}; the run uses its own, "
                f"{_function(config, name)}" for name in FUNCTION_FIELDS
                if _function(self.config, name) != _function(config, name)]

    def fingerprint(self) -> str:
        """sha256 of what the weights are: a checkpoint's manifests (which hold every file's checksum), an HF
        directory's config.json and safetensors files, in name order."""
        digest = hashlib.sha256()
        if self.kind == "checkpoint":
            files = sorted(self.path.glob("manifest*.json"))
        else:
            files = [self.path / "config.json", *sorted(safetensors_files(self.path))]
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with reading.open_regular(path, "a weight file") as handle:
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"

    def load_into(self, model: Zaya, process_group=None, views: ExpertViews | None = None) -> None:
        """Fill `model`'s parameters and persistent buffers in place, whether they are whole tensors or FSDP2's
        DTensor shards (a checkpoint is resharded by DCP; an HF directory is read whole by every rank, each
        keeping its shard, and under expert parallelism (`views`) its experts); every rank of the model's mesh
        calls it."""
        if self.kind == "checkpoint":
            state = get_model_state_dict(model)
            whole = state if views is None else views.whole(state)  # filled in place: fills `state`
            checkpoint.load_tensors(self.path, {"model": whole}, process_group=process_group)
            set_model_state_dict(model, state)
            return
        with torch.device("meta"):
            expected = {name: tensor.shape for name, tensor in Zaya(self.config).state_dict().items()}
        full = load_hf_state(self.path, self.config, expected, self.layout)
        if views is not None:
            full = views.rows(full)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))

