"""Opening a dataset: its manifest read within a cap (64 MiB) and checked field by field (`zaya.schema`), and
every file it lists checked to be a regular file of the size it says; checksums on request. A chat dataset's
loss masks and chat template are files of the manifest like the others."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
from tqdm import tqdm

from zaya.data.content import Stream
from zaya.data.shards import (
    DTYPES,
    FORMAT,
    MANIFEST_FILE,
    SPLITS,
    VERSION,
    FileEntry,
    SplitEntry,
    fingerprint_of,
    plain_name,
    sha256_file,
)
from zaya.data.split_tokens import SplitTokens
from zaya.errors import ZayaError
from zaya.reading import check_depth, os_reason, read_bytes
from zaya.schema import Fields, shown


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
        self._verify_content()
        return len(entries)

    def _verify_content(self) -> None:
        """The content each split records (what the fingerprint is taken over) is what its files hold."""
        for name, split in self.manifest["splits"].items():
            recorded = split.get("content")
            if recorded is None:
                continue
            tokens = self.split(name)
            found = {"tokens": Stream(), "documents": Stream().extend(np.diff(tokens.document_ends(), prepend=0))}
            if "mask" in recorded:
                found["mask"] = Stream()
            for start in range(0, tokens.num_tokens, _VERIFY_CHUNK):
                stop = min(tokens.num_tokens, start + _VERIFY_CHUNK)
                found["tokens"] = found["tokens"].extend(tokens.read(start, stop))
                if "mask" in found:
                    found["mask"] = found["mask"].extend(tokens.read_mask(start, stop))
            for key, stream in found.items():
                if stream.text() != recorded[key]:
                    raise ZayaError(f"{self.path / MANIFEST_FILE}: the {name} split's {key} do not hash to the "
                                    "content the manifest records (its files were changed after it was written)")

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
    manifest, splits = read_manifest(path)
    dataset = Dataset(path, manifest, splits)
    for entry in dataset.files():
        _check_size(path / entry.file, entry.bytes)
    return dataset


def read_manifest(path: Path) -> tuple[dict, dict[str, SplitEntry]]:
    """The manifest of the dataset directory `path`, read within the cap for a manifest (64 MiB) and checked
    field by field (types, ranges, plain file names, sizes that agree with the counts); its files are not
    looked at. Any fault is one `ZayaError` naming the manifest and the field."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir():
        raise ZayaError(f"{path}: no such dataset directory")
    if not os.path.lexists(manifest_path):
        raise ZayaError(f"{manifest_path}: file not found; is '{path}' a dataset built by 'zaya data build'?")
    data = read_bytes(manifest_path, "manifest", "a dataset manifest")
    try:
        manifest = json.loads(data)
    except RecursionError:
        raise ZayaError(f"{manifest_path}: not a readable manifest (nested too deeply)") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of too many digits
        raise ZayaError(f"{manifest_path}: not a readable manifest ({str(exc)[:200]})") from None
    try:
        check_depth(manifest, manifest_path)
    except ZayaError:
        raise ZayaError(f"{manifest_path}: not a readable manifest (nested too deeply)") from None
    doc = Fields(manifest, manifest_path)
    if doc.str("format", max_len=100) != FORMAT:
        raise ZayaError(f"{manifest_path}: field 'format' is {shown(manifest['format'])}, expected {FORMAT!r}")
    if doc.int("version") != VERSION:
        raise ZayaError(f"{manifest_path}: field 'version' is {manifest['version']}, this zaya reads {VERSION}")
    dtype = doc.str("dtype", choices=tuple(DTYPES))
    corpus = doc.obj("corpus")
    for key in ("text_bytes", "documents", "bad_records", "invalid_utf8_documents", "files"):  # facts, if there
        corpus.int(key, None, lo=0)  # (older manifests also counted the input files)
    tokenizer = doc.obj("tokenizer")
    _file_entry(tokenizer)
    vocab_size = tokenizer.int("vocab_size", lo=1, hi=_MAX_VOCAB)
    tokenizer.int("eos_id", lo=0, hi=vocab_size - 1)
    tokenizer.dict("special_ids", of=int)
    for name, value in tokenizer.data["special_ids"].items():
        if not 0 <= value < vocab_size:
            raise ZayaError(f"{manifest_path}: field 'tokenizer.special_ids.{shown(name)}' must be an id in "
                            f"0..{vocab_size - 1}, got {value}")
    chat = tokenizer.obj("chat_template", None)
    if chat is not None:
        _file_entry(chat)
        chat.str("end_of_turn", max_len=1000)
    masked = doc.bool("loss_mask", False)
    itemsize = DTYPES[dtype].itemsize
    splits_field = doc.obj("splits")
    splits = {name: _split_entry(splits_field.obj(name), name, itemsize, masked) for name in SPLITS}
    return manifest, splits


_MAX_VOCAB = 1 << 32
_VERIFY_CHUNK = 1 << 24  # tokens hashed at once by `verify`
_MAX_SHARDS = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _split_entry(split: Fields, name: str, itemsize: int, masked: bool) -> SplitEntry:
    source = split.source
    shards, counts, masks = [], [], []
    for i, item in enumerate(split.list("shards", of=dict, max_len=_MAX_SHARDS)):
        shard = Fields(item, source, split.key(f"shards[{i}]"))
        entry = _file_entry(shard)
        count = shard.int("num_tokens", lo=0)
        if count * itemsize != entry.bytes:
            raise ZayaError(f"{source}: field '{shard.key('bytes')}' is {entry.bytes}, but {count} tokens take "
                            f"{count * itemsize}")
        if masked:
            mask = _file_entry(shard.obj("mask"))
            if mask.bytes != count:
                raise ZayaError(f"{source}: field '{shard.key('mask.bytes')}' is {mask.bytes}, but the shard has "
                                f"{count} tokens (one mask byte each)")
            masks.append(mask)
        elif "mask" in shard:
            raise ZayaError(f"{source}: field '{shard.key('mask')}' in a dataset without 'loss_mask': true")
        shards.append(entry)
        counts.append(count)
    num_tokens = split.int("num_tokens", lo=0)
    if sum(counts) != num_tokens:
        raise ZayaError(f"{source}: field '{split.key('num_tokens')}' is {num_tokens}, but the shards hold "
                        f"{sum(counts)}")
    num_documents = split.int("num_documents", lo=0)
    documents = _file_entry(split.obj("documents"))
    if documents.bytes != 8 * num_documents:
        raise ZayaError(f"{source}: field '{split.key('documents.bytes')}' is {documents.bytes}, but "
                        f"{num_documents} documents take {8 * num_documents}")
    if "content" in split:
        _check_content(split.obj("content"), {"tokens": num_tokens, "documents": num_documents,
                                              **({"mask": num_tokens} if masked else {})})
    max_token_id = split.data.get("max_token_id")
    if max_token_id is not None:
        max_token_id = split.int("max_token_id", lo=0)
    return SplitEntry(
        name=name,
        num_tokens=num_tokens,
        num_documents=num_documents,
        max_token_id=max_token_id,
        shards=tuple(shards),
        shard_tokens=tuple(counts),
        documents=documents,
        masks=tuple(masks) if masked else None,
        loss_tokens=split.int("loss_tokens", lo=0) if masked else None,
    )


def _check_content(content: Fields, lengths: dict[str, int]) -> None:
    """A split's content hashes (`zaya.data.content`): one per stream, each of the stream's length."""
    extra = sorted(set(content.data) - set(lengths))
    if extra:
        raise ZayaError(f"{content.source}: field '{content.key(extra[0])}' is not a stream of this split")
    for key, length in lengths.items():
        text = content.str(key, max_len=64)
        try:
            stream = Stream.parse(text)
        except ValueError:
            raise ZayaError(f"{content.source}: field '{content.key(key)}' is not a content hash, got "
                            f"{shown(text)}") from None
        if stream.length != length:
            raise ZayaError(f"{content.source}: field '{content.key(key)}' covers {stream.length} values, the split "
                            f"holds {length}")


def _file_entry(entry: Fields) -> FileEntry:
    name = entry.str("file", max_len=255)
    if not plain_name(name):
        raise ZayaError(f"{entry.source}: field '{entry.key('file')}' must be a plain file name, got {shown(name)}")
    digest = entry.str("sha256", max_len=64)
    if not _SHA256.fullmatch(digest):
        raise ZayaError(f"{entry.source}: field '{entry.key('sha256')}' must be a SHA-256 (64 hex digits), got "
                        f"{shown(digest)}")
    return FileEntry(name, entry.int("bytes", lo=0), digest)


def _check_size(path: Path, expected: int) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found (listed in the manifest)") from None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the reader, a device never end
        raise ZayaError(f"{path}: not a regular file (listed in the manifest)")
    if info.st_size != expected:
        raise ZayaError(f"{path}: {info.st_size} bytes, but the manifest says {expected} (truncated or replaced?)")
