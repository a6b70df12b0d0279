"""`zaya data merge`: the N parts of one build (`zaya data build --part I/N`), joined into one dataset.

    parts = open every part; check they are the N parts of one build  (the same `build` hash: input listing,
                                                                         document options, tokenizer; each index
                                                                         0 .. N-1 once)
    shards = every part's shard files, hard-linked under the dataset's own names, part after part
    documents = each split's document ends, the parts' shifted by the tokens before them (8 bytes a document)
    manifest = last, as a build writes it

The token files are not copied: a hard link is a second name of the same file, so a merge takes seconds
whatever the size, and the parts may be deleted afterwards (the dataset keeps the data). Where a part lies on
another file system a link cannot be made, and that shard is copied (the report counts the copies).

A dataset grows the same way (`--onto DATASET`): a new set of parts, a new crawl dump's, say, built with the
dataset's tokenizer, is merged after the dataset's own shards into a new directory, a new version with its own
fingerprint; the dataset it grew from is untouched, and a data mixture takes the new one as one source.

The result holds what a one-machine build of the same inputs with the same tokenizer holds: the same token
stream in the same document order, the same document index, the same val split (membership is by a hash of
the text), and so the same fingerprint, which is taken over the splits' content (`zaya.data.content`), not over
how they are cut into files: here each part's last shard is short (the reader takes shards of any length).
Training on either sees the same samples in the same order (the order is seeded by the fingerprint).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zaya.data.content import Stream
from zaya.data.dataset_reader import Dataset, open_dataset
from zaya.data.dataset_writer import staged_directory
from zaya.data.shards import BUILD_FILE, FORMAT, MANIFEST_FILE, SPLITS, VERSION, fingerprint_of
from zaya.data.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.reading import os_reason

# the corpus facts a merge adds up
_SUMMED = ("text_bytes", "documents", "bad_records", "invalid_utf8_documents")


@dataclass
class MergeReport:
    path: Path
    fingerprint: str
    parts: int
    tokens: int
    documents: int
    bad_records: int
    shard_bytes: int
    copied: int  # shards copied, not linked (their part lay on another file system)


def merge_parts(parts: Sequence[Path | str], out: Path | str, overwrite: bool = False,
                onto: Path | str | None = None) -> MergeReport:
    """Join the parts of one build into the dataset `out`, after the dataset `onto` where given (see the module
    docstring); any fault is one `ZayaError` and leaves nothing at `out`."""
    datasets = _checked_parts([Path(p) for p in parts])
    if onto is not None:
        if Path(out).resolve() == Path(onto).resolve():
            raise ZayaError(f"{out}: the merge grows {onto} into a new version: give --out another directory")
        base = open_dataset(onto)
        _check_same_kind(base, datasets[0])
        datasets = [base, *datasets]
    first = datasets[0]
    copied = 0
    with staged_directory(Path(out), overwrite) as staging:
        splits = {}
        for name in SPLITS:
            splits[name], n = _merge_split(name, datasets, staging)
            copied += n
        shutil.copyfile(first.tokenizer_path, staging / TOKENIZER_FILE)
        if first.chat_template_path is not None:
            shutil.copyfile(first.chat_template_path, staging / CHAT_TEMPLATE_FILE)
        corpus = {key: sum(d.manifest["corpus"].get(key, 0) for d in datasets) for key in _SUMMED}
        manifest = {key: first.manifest[key] for key in ("format", "version", "dtype", "shard_tokens", "tokenizer")}
        manifest.update(splits=splits, corpus=corpus)
        if first.manifest.get("loss_mask"):
            manifest["loss_mask"] = True
        info = {"merged_from": [str(d.path) for d in datasets], "parts": len(parts), "copied_shards": copied,
                "build": datasets[-1].manifest["corpus"]["part"]["build"]}
        if onto is not None:
            info["grew_from"] = {"path": str(first.path), "fingerprint": first.fingerprint}
        (staging / BUILD_FILE).write_text(json.dumps(info, indent=2) + "\n")
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return MergeReport(Path(out), fingerprint_of(manifest), len(parts),
                       sum(s["num_tokens"] for s in splits.values()), corpus["documents"], corpus["bad_records"],
                       sum(f["bytes"] for s in splits.values() for f in s["shards"]), copied)


def _checked_parts(paths: list[Path]) -> list[Dataset]:
    """The parts in index order, after checking that they are all N parts of one build, each once."""
    if not paths:
        raise ZayaError("zaya data merge needs the parts to merge")
    datasets = [open_dataset(path) for path in paths]
    first = None
    by_index: dict[int, Dataset] = {}
    for dataset in datasets:
        part = dataset.manifest["corpus"].get("part")
        if not isinstance(part, dict) or not {"index", "count", "build"} <= set(part):
            raise ZayaError(f"{dataset.path}: not a part of a build (build it with `zaya data build --part I/N`)")
        if first is None:
            first = (dataset, part)
        elif part["build"] != first[1]["build"] or part["count"] != first[1]["count"]:
            raise ZayaError(f"{dataset.path}: a part of another build than {first[0].path} (another input listing, "
                            "tokenizer or document options, or another number of parts)")
        _check_same_kind(first[0], dataset)
        twin = by_index.get(part["index"])
        if twin is not None:
            raise ZayaError(f"{dataset.path}: part {part['index']} is given twice (also {twin.path})")
        by_index[part["index"]] = dataset
    count = first[1]["count"]
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise ZayaError(f"part {missing[0]} of {count} is missing ({len(missing)} missing in all): give every part "
                        "of the build")
    if first[0].manifest.get("format") != FORMAT or first[0].manifest.get("version") != VERSION:
        raise ZayaError(f"{first[0].path}: not a dataset of this zaya's format")
    return [by_index[i] for i in range(count)]


def _check_same_kind(first: Dataset, other: Dataset) -> None:
    """The two hold tokens of one tokenizer, in one dtype, with the same record of it and of their loss mask."""
    for key in ("format", "version", "dtype", "tokenizer", "loss_mask"):
        if other.manifest.get(key) != first.manifest.get(key):
            raise ZayaError(f"{other.path}: its manifest's '{key}' differs from {first.path}'s (another tokenizer, "
                            "or another kind of dataset)")


def _merge_split(name: str, datasets: list[Dataset], staging: Path) -> tuple[dict, int]:
    """One split's manifest entry, its shards linked (or copied) into `staging` and its document ends
    written there; and how many shards were copied."""
    shards, ends, copied, offset, loss_tokens, max_ids = [], [], 0, 0, 0, []
    content: dict[str, Stream] | None = {}
    for dataset in datasets:
        entry = dataset.entries[name]
        split = dataset.manifest["splits"][name]
        if content is not None and "content" in split:
            for key, text in split["content"].items():
                content[key] = content.get(key, Stream()).join(Stream.parse(text))
        else:  # a dataset from before the content was recorded: the merge has none either
            content = None
        for item in split["shards"]:
            target = f"{name}.{len(shards):05d}.bin"
            copied += _link(dataset.path / item["file"], staging / target)
            new = {**item, "file": target}
            if "mask" in item:
                mask = f"{name}.{len(shards):05d}.mask.bin"
                copied += _link(dataset.path / item["mask"]["file"], staging / mask)
                new["mask"] = {**item["mask"], "file": mask}
            shards.append(new)
        part_ends = np.fromfile(dataset.path / entry.documents.file, dtype="<i8")
        if len(part_ends) != entry.num_documents:
            raise ZayaError(f"{dataset.path / entry.documents.file}: holds {len(part_ends)} document ends, the "
                            f"manifest says {entry.num_documents}")
        ends.append(part_ends + offset)
        offset += entry.num_tokens
        loss_tokens += entry.loss_tokens or 0
        if entry.max_token_id is not None:
            max_ids.append(entry.max_token_id)
    documents = np.concatenate(ends).astype("<i8") if ends else np.zeros(0, dtype="<i8")
    docs_file = f"{name}.docs.bin"
    data = documents.tobytes()
    (staging / docs_file).write_bytes(data)
    merged = {"shards": shards, "num_tokens": offset, "num_documents": len(documents),
              "max_token_id": max(max_ids) if max_ids else None,
              "documents": {"file": docs_file, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    if datasets[0].manifest.get("loss_mask"):
        merged["loss_tokens"] = loss_tokens
    if content is not None:
        merged["content"] = {key: stream.text() for key, stream in content.items()}
    return merged, copied


def _link(source: Path, target: Path) -> int:
    """Hard-link `source` as `target` (0), or copy it where the two lie on different file systems (1)."""
    try:
        os.link(source, target)
        return 0
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise ZayaError(f"{source}: cannot link into the merged dataset ({os_reason(exc)})") from None
    try:
        shutil.copyfile(source, target)
    except OSError as exc:
        raise ZayaError(f"{source}: cannot copy into the merged dataset ({os_reason(exc)})") from None
    return 1
