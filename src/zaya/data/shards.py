"""The on-disk dataset: flat token files grouped into super-shards, a document index, and a manifest.

    dataset/
        manifest.json         files with sizes and SHA-256, token and document counts, the tokenizer's hash
        tokenizer.json        the tokenizer the tokens were made with
        train.00000.bin ...   the train split's tokens, flat little-endian uint16 (vocab <= 65536) or uint32
        train.docs.bin        little-endian int64: where each document ends in the split's token stream
        val.00000.bin ...     the held-out validation split, likewise
        val.docs.bin
        build.json            how it was built (inputs, options, skipped files and records, warnings); not
                              part of the fingerprint

    and in a chat dataset (`zaya data build --format chat`) also
        chat_template.jinja   the chat template the documents were rendered with (the tokenizer's entry lists it)
        train.00000.mask.bin  the loss mask of train.00000.bin: one byte per token, 1 where the model learns to
        ...                   produce the token (the assistant turns), 0 elsewhere; the shard's entry lists it

A split is one token stream stored as super-shards of `shard_tokens` tokens each (the last one shorter), so
that large sequential reads stay inside one big file; a read that crosses a shard boundary is served from
both files. Every document ends with the tokenizer's end-of-document token.

A chat dataset's manifest says `"loss_mask": true`; a text dataset's has no such key, nor mask entries, so its
manifest and fingerprint are what they were before chat datasets existed.

The fingerprint is the SHA-256 of the manifest's canonical JSON. The manifest holds no paths, times or
build options, so two builds of the same inputs have the same fingerprint wherever they are written, and a
change to any token, mask byte or chat template changes a checksum and with it the fingerprint. Each split also
records its content, hashes of its token stream, document lengths and mask that parts of a build join
(`content.py`); where it does, the fingerprint is taken over the content instead of the file listing, so that a
dataset built in parts and merged (`merge.py`), whose shards are cut elsewhere, has the fingerprint of the same
inputs built in one go. (Manifests written before the content was recorded keep their fingerprints.)

`dataset_writer.py` writes a dataset; `dataset_reader.py` opens one and checks its manifest, and
`split_tokens.py` reads a split's tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from zaya.errors import ZayaError
from zaya.reading import open_regular, os_reason

FORMAT = "zaya-dataset"
VERSION = 1
MANIFEST_FILE = "manifest.json"
BUILD_FILE = "build.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per super-shard
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_CHUNK = 1 << 22


def plain_name(name: str) -> bool:
    """A name of one entry of a directory: not empty, `.` or `..`, no separator or NUL, at most 255 bytes (what a
    manifest or a saved dataset's metadata may name, so that it stays inside its directory)."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name
            and len(name.encode("utf-8", "surrogatepass")) <= 255)


def token_dtype(vocab_size: int) -> str:
    """The narrowest token type that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def fingerprint_of(manifest: dict) -> str:
    """The dataset fingerprint: SHA-256 of the manifest's canonical JSON (sorted keys, no whitespace). Where every
    split records its content (`zaya.data.content`: datasets built since datasets could be built in parts), of
    the manifest without its file listings and shard size, with the content in their place: the same for the same
    token stream, documents and mask however they are cut into files, so that parts merged have a one-machine
    build's fingerprint; a manifest without content keeps the fingerprint it always had."""
    splits = manifest.get("splits")
    if isinstance(splits, dict) and splits and all(isinstance(v, dict) and "content" in v for v in splits.values()):
        manifest = {**{k: v for k, v in manifest.items() if k != "shard_tokens"},
                    "splits": {name: {k: v for k, v in split.items() if k not in ("shards", "documents")}
                               for name, split in splits.items()}}
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def sha256_file(path: Path, progress: tqdm | None = None) -> str:
    """SHA-256 of a regular file, read in large chunks (a FIFO or device in its place is one `ZayaError`)."""
    digest = hashlib.sha256()
    with open_regular(path, "a dataset file") as handle:
        try:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                if progress is not None:
                    progress.update(len(chunk))
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """A file listed in the manifest."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitEntry:
    """One split as the manifest describes it."""

    name: str
    num_tokens: int
    num_documents: int
    max_token_id: int | None
    shards: tuple[FileEntry, ...]
    shard_tokens: tuple[int, ...]
    documents: FileEntry
    masks: tuple[FileEntry, ...] | None = None  # the loss mask beside each shard, in a chat dataset
    loss_tokens: int | None = None  # how many tokens the mask flags
