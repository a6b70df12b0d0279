"""The weight files of a Hugging Face directory: one `model.safetensors`, or shards
`model-00001-of-0000N.safetensors` listed in `model.safetensors.index.json` (transformers' layout), written
and read.

Each file is written by `safetensors.torch.save_file`, which writes a temporary file created with mode 0600 and
renames it into place: the weights of an export would be private to their owner whatever the umask, so the
file then gets the mode of any file the user creates (0666 & ~umask).
"""

from __future__ import annotations

import json
import os
import re
import stat
from decimal import Decimal
from pathlib import Path

import torch
from safetensors.torch import save_file

from zaya import reading
from zaya.errors import ZayaError
from zaya.schema import Fields

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' and the Hub's convention: a 5 GB shard still downloads and memory-maps comfortably
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, name: str = "size") -> int:
    """Bytes from `5GB`, `500MB`, `2GiB`, `1.5GB` or a plain number of bytes (GB = 10**9, GiB = 2**30)."""
    match = _SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    size = int(Decimal(match.group(1)) * unit) if match and unit else 0
    if size < 1:
        raise ZayaError(f"{name}: {text!r} is not a size; give bytes, or a number with KB, MB, GB, KiB, MiB or "
                        "GiB (e.g. 5GB, 500MB, 2GiB)")
    return size


# ---- writing ------------------------------------------------------------------------------------------


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    return tensor.numel() * (dtype or tensor.dtype).itemsize


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Write `tensors` (cast to `dtype` if given) as one safetensors file with the library, with the mode of any
    file the user creates (0666 & ~umask) rather than the 0600 of the temporary file `save_file` renames into
    place."""
    for key, tensor in tensors.items():
        if (dtype or tensor.dtype) not in _DTYPES:
            raise ZayaError(f"{path}: tensor '{key}' has dtype {tensor.dtype}, which safetensors cannot store")
    save_file({key: tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
               for key, tensor in tensors.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting it and back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, grouped into shards of at most `max_shard_bytes`; a tensor larger than that is alone in
    its shard (a tensor is never split)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for key, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += size
    return shards


def write_weights(directory: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write `tensors` into `directory` as `model.safetensors` when they total at most `max_shard_bytes`, else
    as shards filled in key order plus `model.safetensors.index.json`; returns the files written."""
    directory = Path(directory)
    sizes = {key: _nbytes(tensor, dtype) for key, tensor in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, tensors, dtype)
        return [directory / SINGLE_FILE]
    weight_map, files = {}, []
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / name, {key: tensors[key] for key in keys}, dtype)
        weight_map.update(dict.fromkeys(keys, name))
        files.append(directory / name)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    with (directory / INDEX_FILE).open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return [*files, directory / INDEX_FILE]


# ---- reading ------------------------------------------------------------------------------------------


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """The index's tensor -> file map (None without an index), each file a plain name inside `directory`: an
    index must not make a loader open files elsewhere."""
    index = Path(directory) / INDEX_FILE
    if not os.path.lexists(index):
        return None
    weight_map = Fields(reading.read_json_object(index, "document", "a safetensors index"), index).dict("weight_map")
    for key, name in weight_map.items():
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ZayaError(f"{index}: entry '{key}' names {name!r}, not a file name inside {directory}")
    return weight_map


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: the index's shards, or `model.safetensors`, or every *.safetensors."""
    directory = Path(directory)
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        files = [directory / name for name in sorted(set(weight_map.values()))]
    elif os.path.lexists(directory / SINGLE_FILE):
        files = [directory / SINGLE_FILE]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ZayaError(f"{directory}: no *.safetensors weight files")
    for file in files:
        try:
            mode = os.stat(file).st_mode
        except FileNotFoundError:
            listed = f"listed in {INDEX_FILE} " if weight_map is not None else ""
            raise ZayaError(f"{file}: weight file {listed}is missing") from None
        except OSError as exc:
            raise ZayaError(f"{file}: cannot read ({reading.os_reason(exc)})") from None
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ZayaError(f"{file}: {kind}; a weight file must be a safetensors file")
    return files
