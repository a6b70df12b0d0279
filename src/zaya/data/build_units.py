"""How `zaya data build` shares out its work: input files cut into pieces of a size that keeps every worker
busy, pieces grouped into units of about that much work, and the order the units run in; and a build's parts
(`--part I/N`): which pieces each takes, and what identifies the parts of one build.

The cuts depend on the corpus's size and the number of workers, but the output does not: results are
written in piece order whatever the units were."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

from zaya.data.corpus import InputFile, Piece, ReadOptions, split_file

_MIN_PIECE_BYTES = 1 << 18
_MAX_PIECE_BYTES = 1 << 23
# text compresses about 4:1: a compressed file counts for four times its size when work is shared out
_COMPRESSION_RATIO = 4


def target_bytes(total: int, workers: int) -> int:
    """About total / (16 * workers) bytes of work per job, so every worker gets several and none waits long."""
    return min(_MAX_PIECE_BYTES, max(_MIN_PIECE_BYTES, total // (16 * workers)))


def plan_pieces(files: Sequence[InputFile], read: ReadOptions, workers: int) -> list[Piece]:
    target = target_bytes(sum(f.size for f in files), workers)
    return [piece for i, f in enumerate(files) for piece in split_file(f, i, read, target)]


def part_pieces(files: Sequence[InputFile], read: ReadOptions, part: int, parts: int) -> list[Piece]:
    """The pieces of part `part` (0-based) of a build cut into `parts` parts (`zaya data build --part`): the input
    listing cut into pieces by its sizes alone (record-aligned byte ranges of large line files, whole compressed
    files and tables), then shared out as `parts` runs of consecutive pieces of about equal work, a piece going to
    the part in which the middle of its work falls. Every part computes the same cuts from the same listing, the
    parts are disjoint and cover every piece, and in part order they are the pieces in input order, so the
    parts' documents, one part after the other, are a one-machine build's in its order. A part may be empty."""
    target = max(_MIN_PIECE_BYTES, sum(f.size for f in files) // (4 * parts))
    pieces = [piece for i, f in enumerate(files) for piece in split_file(f, i, read, target)]
    work = [piece_work(files, p) for p in pieces]
    total = sum(work) or 1
    mine, done = [], 0
    for piece, w in zip(pieces, work, strict=True):
        if int((2 * done + w) * parts // (2 * total)) == part:
            mine.append(piece)
        done += w
    return mine


def part_identity(options, files: Sequence[InputFile], tokenizer_sha256: str) -> dict:
    """A part's record in its manifest (`options`: the build's `BuildOptions`): its index, the number of parts,
    and `build`, a hash of what makes the parts of one build: the input listing (each file's path below the
    files' common directory, kind, compression and size: the same from any working directory or mount point),
    the options that change the documents, and the tokenizer. `zaya data merge` joins only parts that agree on
    it."""
    paths = [os.path.abspath(f.path) for f in files]
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    listing = [[os.path.relpath(path, root), f.kind, f.compression, f.size]
               for path, f in zip(paths, files, strict=True)]
    documents = {"val_fraction": options.val_fraction, "text_field": options.text_field, "format": options.format,
                 "doc_separator": options.doc_separator, "eos_token": options.eos_token, "strict": options.strict,
                 "split": options.split}
    build = json.dumps({"listing": listing, "options": documents, "tokenizer": tokenizer_sha256}, sort_keys=True)
    index, count = options.part
    return {"index": index, "count": count, "build": hashlib.sha256(build.encode("utf-8")).hexdigest()}


def piece_work(files: Sequence[InputFile], piece: Piece) -> int:
    """A piece's share of the tokenizing, in bytes: its size on disk, or an estimate of its text if compressed."""
    return piece.size * (_COMPRESSION_RATIO if files[piece.file].compression else 1)


def group_units(pieces: Sequence[Piece], work: Sequence[int], target: int) -> list[tuple[Piece, ...]]:
    """Consecutive pieces grouped into units of about `target` bytes of work: small files share a unit, and a
    piece of `target` bytes or more is a unit of its own."""
    units: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    size = 0
    for piece, amount in zip(pieces, work, strict=True):
        if amount >= target:
            if current:
                units.append(tuple(current))
                current, size = [], 0
            units.append((piece,))
            continue
        current.append(piece)
        size += amount
        if size >= target:
            units.append(tuple(current))
            current, size = [], 0
    if current:
        units.append(tuple(current))
    return units


def run_order(sizes: Sequence[int], workers: int) -> list[int]:
    """The order to run units in: the largest first within each run of 4 * workers units, so that no worker
    is left alone with a big one at the end. Results wait for their turn to be written, at most one run's."""
    window = 4 * workers
    order: list[int] = []
    for start in range(0, len(sizes), window):
        order.extend(sorted(range(start, min(start + window, len(sizes))), key=lambda i: (-sizes[i], i)))
    return order
