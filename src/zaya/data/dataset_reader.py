"""Opening a dataset: its manifest checked field by field and every file's size against it; checksums on
request. A chat dataset's loss masks and chat template are files of the manifest like the others."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

from zaya.data.shards import (
    DTYPES,
    FORMAT,
    MANIFEST_FILE,
    SPLITS,
    VERSION,
    FileEntry,
    SplitEntry,
    fingerprint_of,
    sha256_file,
)
from zaya.data.split_tokens import SplitTokens
from zaya.errors import ZayaError


class Dataset:
    """An opened dataset directory. Use `open_dataset` to make one."""

    def __init__(self, path: Path, manifest: dict, splits: dict[str, SplitEntry]) -> None:
        self.path = path
        self.manifest = manifest
        self.fingerprint = fingerprint_of(manifest)
        self.dtype = DTYPES[manifest["dtype"]]
        self.entries = splits
        tokenizer = manifest["tokenizer"]
        self.vocab_size: int = tokenizer["vocab_size"]
        self.eos_id: int = tokenizer["eos_id"]
        self.special_ids: dict[str, int] = tokenizer["special_ids"]
        self.tokenizer_sha256: str = tokenizer["sha256"]
        self.tokenizer_path = path / tokenizer["file"]
        # whether each token comes with a loss-mask flag (a chat dataset), and its chat template if it has one
        self.has_loss_mask: bool = manifest.get("loss_mask", False)
        chat = tokenizer.get("chat_template")
        self.chat_template_path: Path | None = None if chat is None else path / chat["file"]
        self.end_of_turn: str | None = None if chat is None else chat["end_of_turn"]
        self._opened: dict[str, SplitTokens] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens in all splits together."""
        return sum(entry.num_tokens for entry in self.entries.values())

    @property
    def num_documents(self) -> int:
        """Documents in all splits together."""
        return sum(entry.num_documents for entry in self.entries.values())

    @property
    def max_token_id(self) -> int:
        """The largest token id in the data (-1 for a dataset without tokens)."""
        ids = [entry.max_token_id for entry in self.entries.values() if entry.max_token_id is not None]
        return max(ids, default=-1)

    def split(self, name: str) -> SplitTokens:
        """The token stream of a split ("train" or "val")."""
        if name not in self.entries:
            raise ZayaError(f"{self.path}: no split '{name}' (splits: {', '.join(self.entries)})")
        if name not in self._opened:
            # the largest id the manifest admits (an older manifest without the field: the tokenizer's last)
            limit = self.max_token_id if self.max_token_id >= 0 else self.vocab_size - 1
            self._opened[name] = SplitTokens(self.path, self.entries[name], self.dtype, limit)
        return self._opened[name]

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse a model whose vocabulary cannot embed every token id of this dataset."""
        if self.max_token_id >= model_vocab_size:
            raise ZayaError(
                f"{self.path}: token id {self.max_token_id} does not fit the model's vocabulary of "
                f"{model_vocab_size} (the dataset's tokenizer has {self.vocab_size} entries); use a model with "
                f"vocab_size >= {self.vocab_size} or rebuild the data with --vocab-size {model_vocab_size}"
            )

    def files(self) -> list[FileEntry]:
        """Every file the manifest lists."""
        tokenizer = self.manifest["tokenizer"]
        entries = [FileEntry(tokenizer["file"], tokenizer["bytes"], tokenizer["sha256"])]
        if "chat_template" in tokenizer:
            chat = tokenizer["chat_template"]
            entries.append(FileEntry(chat["file"], chat["bytes"], chat["sha256"]))
        for entry in self.entries.values():
            entries.extend(entry.shards)
            entries.extend(entry.masks or ())
            entries.append(entry.documents)
        return entries

    def verify(self, progress: bool = False) -> int:
        """Recompute every checksum; raises a `ZayaError` naming the first file that does not match.

        Returns the number of files checked."""
        entries = self.files()
        with tqdm(total=sum(e.bytes for e in entries), unit="B", unit_scale=True, desc="verifying",
                  disable=not progress) as bar:
            for entry in entries:
                actual = sha256_file(self.path / entry.file, bar)
                if actual != entry.sha256:
                    raise ZayaError(f"{self.path / entry.file}: checksum mismatch (the manifest says "
                                    f"{entry.sha256[:16]}..., the file has {actual[:16]}...)")
        return len(entries)

    def summary(self) -> dict:
        """The manifest's key facts, for `zaya data inspect`."""
        return {
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "dtype": self.manifest["dtype"],
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "max_token_id": self.max_token_id,
            "tokenizer": self.manifest["tokenizer"],
            "splits": {
                name: {"num_tokens": e.num_tokens, "num_documents": e.num_documents, "shards": len(e.shards),
                       "bytes": sum(s.bytes for s in e.shards),
                       **({} if e.loss_tokens is None else {"loss_tokens": e.loss_tokens})}
                for name, e in self.entries.items()
            },
            "corpus": self.manifest["corpus"],
            "loss_mask": self.has_loss_mask,
        }


def open_dataset(path: str | Path) -> Dataset:
    """Open a dataset directory, checking its manifest and that every file is there with the right size.

    Checksums are not recomputed here (that reads everything); `Dataset.verify` does it."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise ZayaError(f"{path}: no such dataset directory")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{manifest_path}: file not found; is '{path}' a dataset built by 'zaya data build'?") from None
    except (OSError, ValueError) as exc:
        raise ZayaError(f"{manifest_path}: not a readable manifest ({exc})") from None
    except RecursionError:
        raise ZayaError(f"{manifest_path}: not a readable manifest (nested too deeply)") from None
    fields = _Fields(manifest_path)
    if fields.get(manifest, "format", str) != FORMAT:
        raise ZayaError(f"{manifest_path}: field 'format' is {manifest['format']!r}, expected {FORMAT!r}")
    if fields.get(manifest, "version", int) != VERSION:
        raise ZayaError(f"{manifest_path}: field 'version' is {manifest['version']}, this zaya reads {VERSION}")
    if fields.get(manifest, "dtype", str) not in DTYPES:
        raise ZayaError(f"{manifest_path}: field 'dtype' is {manifest['dtype']!r}, expected uint16 or uint32")
    fields.get(manifest, "corpus", dict)
    tokenizer = fields.get(manifest, "tokenizer", dict)
    _file_entry(fields, tokenizer, "tokenizer.")
    for key, kind in (("vocab_size", int), ("eos_id", int), ("special_ids", dict)):
        fields.get(tokenizer, key, kind, "tokenizer.")
    if "chat_template" in tokenizer:
        chat = fields.get(tokenizer, "chat_template", dict, "tokenizer.")
        _file_entry(fields, chat, "tokenizer.chat_template.")
        fields.get(chat, "end_of_turn", str, "tokenizer.chat_template.")
    masked = fields.get(manifest, "loss_mask", bool) if "loss_mask" in manifest else False
    itemsize = DTYPES[manifest["dtype"]].itemsize
    splits_field = fields.get(manifest, "splits", dict)
    splits = {name: _split_entry(fields, splits_field, name, itemsize, masked) for name in SPLITS}
    dataset = Dataset(path, manifest, splits)
    for entry in dataset.files():
        _check_size(path / entry.file, entry.bytes)
    return dataset


class _Fields:
    """Typed access to manifest fields, with errors that name the file and the field."""

    def __init__(self, source: Path) -> None:
        self.source = source

    def get(self, obj: dict, key: str, kind: type, prefix: str = "") -> Any:
        if key not in obj:
            raise ZayaError(f"{self.source}: missing field '{prefix}{key}'")
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ZayaError(f"{self.source}: field '{prefix}{key}' must be {kind.__name__}, got {value!r}")
        if kind is int and value < 0:
            raise ZayaError(f"{self.source}: field '{prefix}{key}' must not be negative, got {value}")
        return value


def _split_entry(fields: _Fields, splits: dict, name: str, itemsize: int, masked: bool) -> SplitEntry:
    prefix = f"splits.{name}."
    split = fields.get(splits, name, dict, "splits.")
    shards, counts, masks = [], [], []
    for i, shard in enumerate(fields.get(split, "shards", list, prefix)):
        where = f"{prefix}shards[{i}]."
        if not isinstance(shard, dict):
            raise ZayaError(f"{fields.source}: field '{where[:-1]}' must be an object")
        entry = _file_entry(fields, shard, where)
        count = fields.get(shard, "num_tokens", int, where)
        if count * itemsize != entry.bytes:
            raise ZayaError(f"{fields.source}: field '{where}bytes' is {entry.bytes}, but {count} tokens take "
                            f"{count * itemsize}")
        if masked:
            mask = _file_entry(fields, fields.get(shard, "mask", dict, where), f"{where}mask.")
            if mask.bytes != count:
                raise ZayaError(f"{fields.source}: field '{where}mask.bytes' is {mask.bytes}, but the shard has "
                                f"{count} tokens (one mask byte each)")
            masks.append(mask)
        elif "mask" in shard:
            raise ZayaError(f"{fields.source}: field '{where}mask' in a dataset without 'loss_mask': true")
        shards.append(entry)
        counts.append(count)
    num_tokens = fields.get(split, "num_tokens", int, prefix)
    if sum(counts) != num_tokens:
        raise ZayaError(f"{fields.source}: field '{prefix}num_tokens' is {num_tokens}, but the shards hold "
                        f"{sum(counts)}")
    max_token_id = split.get("max_token_id")
    if max_token_id is not None and (not isinstance(max_token_id, int) or isinstance(max_token_id, bool)):
        raise ZayaError(f"{fields.source}: field '{prefix}max_token_id' must be int or null, got {max_token_id!r}")
    return SplitEntry(
        name=name,
        num_tokens=num_tokens,
        num_documents=fields.get(split, "num_documents", int, prefix),
        max_token_id=max_token_id,
        shards=tuple(shards),
        shard_tokens=tuple(counts),
        documents=_file_entry(fields, fields.get(split, "documents", dict, prefix), f"{prefix}documents."),
        masks=tuple(masks) if masked else None,
        loss_tokens=fields.get(split, "loss_tokens", int, prefix) if masked else None,
    )


def _file_entry(fields: _Fields, obj: dict, prefix: str) -> FileEntry:
    name = fields.get(obj, "file", str, prefix)
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise ZayaError(f"{fields.source}: field '{prefix}file' must be a plain file name, got {name!r}")
    return FileEntry(name, fields.get(obj, "bytes", int, prefix), fields.get(obj, "sha256", str, prefix))


def _check_size(path: Path, expected: int) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found (listed in the manifest)") from None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None
    if actual != expected:
        raise ZayaError(f"{path}: {actual} bytes, but the manifest says {expected} (truncated or replaced?)")
