"""How `zaya data build` shares out its work: input files cut into pieces of a size that keeps every worker
busy, pieces grouped into units of about that much work, and the order the units run in.

The cuts depend on the corpus's size and the number of workers, but the output does not: results are
written in piece order whatever the units were."""

from __future__ import annotations

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
