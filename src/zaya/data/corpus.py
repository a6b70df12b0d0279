"""The inputs of a build: finding the files and reading them as documents.

An input is a file, a directory (searched recursively in sorted order, hidden entries skipped) or the word
`stdlib` (write `./stdlib` for a directory of that name). These kinds of file are read:

- `.txt`: the whole file is one document or, with a document separator, each non-blank piece between
  separators is one;
- `.jsonl`: each line is a JSON object whose text field (`text` unless configured) is one document, or with
  `ReadOptions.chat` whose `messages` are a chat, rendered into one (`chat.py`);
- `.json`: a JSON array of such objects, or JSON lines (`json_array.py`);
- `.csv`, `.tsv`: each row's text column is one document (`delimited.py`);
- `.parquet`, `.arrow`: each row's text column is one document, and a directory written by the Hugging Face
  `datasets` library's `save_to_disk` is read as its arrow files (`tables.py`; needs pyarrow);
- any of the text formats compressed, `.gz` or `.zst`/`.zstd` (`compressed.py`; zstd needs zstandard).

Inside a directory, `Selection` (`--include` / `--exclude` patterns, `patterns.py`) decides which files are
read: without include patterns, every file of a kind above; with them, only the matching files, those of
no known kind read as text (one file, one document, like `.txt`). What is not read is noted, by reason and
kind (`skipped.py`), for the build to say.

`stdlib` stands for the `.py` files of the running interpreter's standard library, read like `.txt` files:
real code that every machine has, which makes it the default demo corpus. Its test suites (`test`, `tests`
and `idle_test` directories, about 60% of its bytes) and any `site-packages` are left out; what remains is
about 12 MB of source, which a two-core machine turns into a dataset in well under a minute.

Files are read in pieces that can be handled independently (byte ranges cut at record boundaries, parquet
row groups, runs of arrow record batches), so a large file is spread over several worker processes; a file
that cannot be cut (compressed, CSV, a JSON array) is one piece, read as a stream. Every piece is read lazily
(`stream_piece`), record by record. Bad text never stops a build: invalid UTF-8 is replaced by U+FFFD and
the document counted. A record that is not a JSON object with a string text field, or a null cell, is a bad
record, returned with its position so the caller can report it by file and line.
"""

from __future__ import annotations

import itertools
import os
import stat
import sysconfig
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import BinaryIO

from zaya.data import tables
from zaya.data.compressed import COMPRESSIONS, jsonl_stream, open_decompressed, text_stream, zstandard_module
from zaya.data.delimited import delimited_stream, header_column
from zaya.data.json_array import array_stream, sniff
from zaya.data.patterns import Selection
from zaya.data.records import (
    InputFile,
    Piece,
    PieceContents,
    ReadOptions,
    Record,
    RecordStream,
    json_record,
    split_records,
    text_record,
    too_long,
)
from zaya.data.skipped import EXCLUDED, HIDDEN, LINKED, SPECIAL, UNMATCHED, UNREAD, SkippedFiles
from zaya.errors import ZayaError
from zaya.reading import open_regular, os_reason

__all__ = [
    "KINDS",
    "STDLIB",
    "InputFile",
    "Piece",
    "PieceContents",
    "ReadOptions",
    "Record",
    "RecordStream",
    "Selection",
    "SkippedFiles",
    "discover",
    "location",
    "read_piece",
    "split_file",
    "stdlib_files",
    "stream_piece",
]

STDLIB = "stdlib"
KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
         ".parquet": "parquet", ".arrow": "arrow"}
# the kinds read as a byte stream, which may therefore also come compressed
_STREAM_KINDS = frozenset({"text", "jsonl", "json", "csv", "tsv"})
_KNOWN = ".txt, .jsonl, .json, .csv, .tsv, .parquet or .arrow, or a compressed .gz/.zst"
# Test suites make up most of the standard library's source; leaving them out keeps the demo corpus small.
_STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_SCAN_BYTES = 1 << 16


# ---- finding the files ----------------------------------------------------------------------------------


def discover(inputs: Sequence[str | Path], selection: Selection | None = None,
             split: str | None = None, skipped: SkippedFiles | None = None) -> list[InputFile]:
    """The files named by `inputs`, in order: directories expanded in sorted order (their files chosen by
    `selection`), `datasets` directories into their arrow files (`split` picks a DatasetDict's split,
    `train` by default), duplicates dropped. What the directories hold and are not read is noted in `skipped`.

    Raises a `ZayaError` for a missing path, an explicitly named file of an unsupported type, a directory
    without readable files, an input whose optional dependency is not installed, or a `split` with no
    DatasetDict among the inputs to take it from."""
    if not inputs:
        raise ZayaError("no inputs given: name files, directories or 'stdlib'")
    selection = selection or Selection()
    seen: set[str] = set()
    files: list[InputFile] = []
    dicts: list[Path] = []  # the saved DatasetDicts met, which `split` chooses from
    for item in inputs:
        for path, kind, compression in _expand(item, selection, split, dicts, skipped):
            key = os.path.realpath(path)  # never raises: a link loop is refused when the file is opened
            if key not in seen:
                seen.add(key)
                files.append(_input_file(path, kind, compression))
    if split is not None and not dicts:
        raise ZayaError(f"--split {split}: none of the inputs is a saved DatasetDict (a directory with "
                        f"{tables.DATASET_DICT}); --split chooses one of its splits")
    return files


def stdlib_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, without test suites or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [path for path in _walk(root, _STDLIB_SKIPPED_DIRS) if path.suffix == ".py"]


def kind_of(name: str) -> tuple[str, str | None] | None:
    """The kind and compression a file name says (`data.jsonl.zst`: jsonl, zstd), or None if unknown."""
    stem, suffix = os.path.splitext(name.lower())
    compression = COMPRESSIONS.get(suffix)
    if compression is not None:
        kind = KINDS.get(os.path.splitext(stem)[1])
        return (kind, compression) if kind in _STREAM_KINDS else None
    kind = KINDS.get(suffix)
    return None if kind is None else (kind, None)


def _as_text(name: str) -> tuple[str, str | None]:
    """A file chosen by --include and of no known kind: text, decompressed if its name says so."""
    return "text", COMPRESSIONS.get(os.path.splitext(name.lower())[1])


Found = tuple[Path, str, str | None]


def _expand(item: str | Path, selection: Selection, split: str | None, dicts: list[Path],
            skipped: SkippedFiles | None) -> list[Found]:
    if str(item) == STDLIB:
        return [(path, "text", None) for path in stdlib_files()]
    path = Path(item)
    info = _stat(path)
    if stat.S_ISDIR(info.st_mode):
        if tables.is_dataset_directory(path):
            return [(p, "arrow", None) for p in _dataset_files(path, split, dicts)]
        here = SkippedFiles()
        found = list(_scan(path, selection, split, dicts, here))
        if not found:
            if selection.include:
                excluded = " and --exclude" if selection.exclude else ""
                raise ZayaError(f"{path}: no files in this directory match --include "
                                f"{' '.join(selection.include)}{excluded}")
            kinds = here.kinds_text()
            has = f"; it has {kinds}" if kinds else ""
            raise ZayaError(f"{path}: no .txt, .jsonl or .parquet files in this directory (nor .json, .csv, .tsv, "
                            f".arrow, compressed files or saved datasets){has}; "
                            f"{here.hint() or '--include PATTERN reads any file as text'}")
        if skipped is not None:
            skipped.update(here)
        return found
    if not stat.S_ISREG(info.st_mode):  # a FIFO, a socket, a device: reading one could wait forever
        raise ZayaError(f"{path}: not a regular file (only files and directories are read)")
    known = kind_of(path.name)
    if known is None:
        if selection.included(path.name):
            return [(path, *_as_text(path.name))]
        suffix = "".join(path.suffixes[-2:]) if path.suffix.lower() in COMPRESSIONS else path.suffix
        raise ZayaError(f"{path}: unsupported file type '{suffix}' (expected {_KNOWN}; --include "
                        f"'*{path.suffix}' reads such files as text)")
    return [(path, *known)]


def _stat(path: Path, listed: bool = False) -> os.stat_result:
    """What `path` is (links followed); a missing path, a loop of links or a name too long is one line.
    `listed`: the path was found in a directory (missing, it is a link to nothing)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if listed:
            raise ZayaError(f"{path}: cannot read (no such file or directory)") from None
        raise ZayaError(f"{path}: no such file or directory") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        reason = os_reason(exc) if isinstance(exc, OSError) else "not a valid file name"
        raise ZayaError(f"{path}: cannot read ({reason})") from None


def _dataset_files(path: Path, split: str | None, dicts: list[Path]) -> list[Path]:
    if tables.is_dataset_dict(path):
        dicts.append(path)
    return tables.dataset_files(path, split)


def _scan(root: Path, selection: Selection, split: str | None, dicts: list[Path],
          skipped: SkippedFiles) -> Iterator[Found]:
    """The selected files under `root`, sorted directory by directory; a saved dataset inside is one entry
    for the patterns, read as its arrow files. Every file and directory passed over is noted in `skipped`."""
    skipped.included = bool(selection.include)
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        relative = here.relative_to(root).as_posix()
        if here != root and tables.is_dataset_directory(here):
            dirnames[:] = []
            if not selection.include or selection.included(relative):
                for p in _dataset_files(here, split, dicts):
                    skipped.read += 1
                    yield (p, "arrow", None)
            else:
                skipped.skip(UNMATCHED, relative, directory=True)
            continue
        prefix = "" if relative == "." else f"{relative}/"
        kept = []
        for d in sorted(dirnames):
            if d.startswith("."):
                skipped.skip(HIDDEN, prefix + d, directory=True)
            elif selection.excluded(prefix + d):
                skipped.skip(EXCLUDED, prefix + d, directory=True)
            elif (here / d).is_symlink():  # os.walk does not follow them (a link may make a loop)
                skipped.skip(LINKED, prefix + d, directory=True)
            else:
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.startswith("."):
                skipped.skip(HIDDEN, prefix + name)
                continue
            if selection.excluded(prefix + name):
                skipped.skip(EXCLUDED, prefix + name)
                continue
            if (here / name).exists() and not (here / name).is_file():  # FIFOs, sockets, devices: never opened
                skipped.skip(SPECIAL, prefix + name)
                continue  # (a dangling link stays: reading it says what is wrong)
            known = kind_of(name)
            if selection.include and not selection.included(prefix + name):
                skipped.skip(UNMATCHED, prefix + name, here / name)
            elif selection.include or known is not None:
                skipped.note_read(name)
                yield (here / name, *(known or _as_text(name)))
            else:
                skipped.skip(UNREAD, prefix + name, here / name)


def _walk(root: Path, skipped_dirs: frozenset[str]) -> Iterator[Path]:
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skipped_dirs)
        for name in sorted(filenames):
            path = Path(directory) / name
            if not name.startswith(".") and not (path.exists() and not path.is_file()):
                yield path


def _input_file(path: Path, kind: str, compression: str | None) -> InputFile:
    info = _stat(path, listed=True)
    if not stat.S_ISREG(info.st_mode):
        raise ZayaError(f"{path}: not a regular file (only files and directories are read)")
    size = info.st_size
    if kind == "parquet":
        tables.parquet_module(path)
    elif kind == "arrow":
        tables.arrow_module(path)
    if compression == "zstd":
        zstandard_module(path)
    if kind == "json":
        with closing(_byte_stream(path, compression)) as stream:
            kind = sniff(stream, path)  # an array, or JSON lines read like .jsonl
    return InputFile(path, kind, size, compression)


# ---- cutting files into pieces --------------------------------------------------------------------------


def streamed(file: InputFile) -> bool:
    """Whether a file is read as one piece, front to back: compressed, CSV, or a JSON array."""
    return file.compression is not None or file.kind in ("json", "csv", "tsv")


def split_file(file: InputFile, index: int, options: ReadOptions, target_bytes: int) -> list[Piece]:
    """Cut the file at record boundaries into pieces of about `target_bytes` (`index` is its input number).

    Checks what can be checked before reading: a table's or CSV header's text column, a file's format."""
    if file.kind == "parquet":
        return tables.parquet_pieces(file, index, options)
    if file.kind == "arrow":
        return tables.arrow_pieces(file, index, options, target_bytes)
    if file.kind in ("csv", "tsv"):
        with closing(_byte_stream(file.path, file.compression)) as stream:
            header_column(stream, file.path, file.kind, options.text_field)
    if streamed(file):
        return [Piece(index, 0, file.size, file.size)]
    separator = b"\n" if file.kind == "jsonl" else _separator_bytes(options)
    if separator is None or file.size <= target_bytes:
        return [Piece(index, 0, file.size, file.size)]
    cuts = [0]
    with _open(file.path) as handle:
        while cuts[-1] + target_bytes < file.size:
            cut = _next_boundary(handle, cuts[-1] + target_bytes, separator, file.path)
            if cut is None or cut >= file.size:
                break
            cuts.append(cut)
    cuts.append(file.size)
    return [Piece(index, a, b, b - a) for a, b in itertools.pairwise(cuts)]


def _next_boundary(handle, position: int, separator: bytes, path: Path) -> int | None:
    """The offset just after the first separator at or after `position`, or None if there is none."""
    overlap = len(separator) - 1
    try:
        handle.seek(position)
        while chunk := handle.read(_SCAN_BYTES):
            found = chunk.find(separator)
            if found >= 0:
                return position + found + len(separator)
            if len(chunk) < _SCAN_BYTES:
                return None
            # step back so a separator straddling two reads is still found
            position += len(chunk) - overlap
            handle.seek(position)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    return None


def _separator_bytes(options: ReadOptions) -> bytes | None:
    return options.doc_separator.encode("utf-8") if options.doc_separator else None


# ---- reading pieces -------------------------------------------------------------------------------------


def stream_piece(file: InputFile, piece: Piece, options: ReadOptions) -> RecordStream:
    """The records of one piece of `file`, read as they are iterated (never the whole piece at once for a
    streamed file). Unreadable or damaged files raise a `ZayaError`; bad records do not."""
    if file.kind == "parquet":
        return RecordStream(tables.parquet_stream(file, piece, options))
    if file.kind == "arrow":
        return RecordStream(tables.arrow_stream(file, piece, options))
    limit = options.record_limit
    if file.compression is not None and file.kind == "jsonl":
        return RecordStream(jsonl_stream(file.path, file.compression, options.text_field, options.chat, limit))
    if file.compression is not None and file.kind == "text":
        return RecordStream(text_stream(file.path, file.compression, _separator_bytes(options), limit))
    if file.kind == "json":
        return RecordStream(_over_stream(
            file, lambda s: array_stream(s, file.path, options.text_field, options.chat, limit)))
    if file.kind in ("csv", "tsv"):
        return RecordStream(_over_stream(
            file, lambda s: delimited_stream(s, file.path, file.kind, options.text_field, limit)))
    return RecordStream(_byte_range(file, piece, options))


def read_piece(file: InputFile, piece: Piece, options: ReadOptions) -> PieceContents:
    """The records of one piece of `file`, all at once (`stream_piece` reads them lazily)."""
    stream = stream_piece(file, piece, options)
    records = list(stream)
    return PieceContents(records, stream.count)


def location(file: InputFile, record: int, options: ReadOptions) -> str:
    """Where record number `record` (0-based, counted over the whole file) is, for messages."""
    if file.kind in ("jsonl", "csv", "tsv"):  # CSV records are numbered by the line they start on
        return f"{file.path}:{record + 1}"
    if file.kind == "json":
        return f"{file.path}: element {record + 1}"
    if file.kind in ("parquet", "arrow"):
        return f"{file.path}: row {record + 1}"
    if options.doc_separator:
        return f"{file.path}: document {record + 1}"
    return str(file.path)


def _unit(kind: str, options: ReadOptions) -> str:
    """What one record of a kind of file is, for messages."""
    if options.chat is not None:
        return "a chat"
    return {"jsonl": "a line", "json": "an element", "csv": "a row", "tsv": "a row"}.get(kind, "a document")


def _open(path: Path) -> BinaryIO:
    return open_regular(path, "an input")


def _byte_stream(path: Path, compression: str | None) -> BinaryIO:
    return _open(path) if compression is None else open_decompressed(path, compression)


def _over_stream(file: InputFile, reader) -> Generator[Record, None, int]:
    with closing(_byte_stream(file.path, file.compression)) as stream:
        return (yield from reader(stream))


def _byte_range(file: InputFile, piece: Piece, options: ReadOptions) -> Generator[Record, None, int]:
    """A plain text or jsonl piece, read a block at a time and cut into records; a record over the bound is a
    bad record whose bytes are skipped, not held."""
    limit = options.record_limit
    with _open(file.path) as handle:
        remaining = piece.stop - piece.start

        def read(size: int) -> bytes:
            nonlocal remaining
            try:
                data = handle.read(min(size, remaining))
            except OSError as exc:
                raise ZayaError(f"{file.path}: cannot read ({os_reason(exc)})") from None
            remaining -= len(data)
            return data

        try:
            handle.seek(piece.start)
        except OSError as exc:
            raise ZayaError(f"{file.path}: cannot read ({os_reason(exc)})") from None
        separator = b"\n" if file.kind == "jsonl" else _separator_bytes(options)
        if separator is None:  # the whole file is one document: not read at all if it is too long
            record = too_long(0, "a document", limit) if remaining > limit else text_record(0, read(limit))
            if record is not None:
                yield record
            return 1
        count = 0
        for raw in split_records(read, separator, limit, keep_lone_empty=file.kind != "jsonl"):
            if raw is None:
                record = too_long(count, _unit(file.kind, options), limit)
            elif file.kind == "jsonl":
                record = json_record(count, raw, options.text_field, options.chat)
            else:
                record = text_record(count, raw)
            if record is not None:
                yield record
            count += 1
    return count
