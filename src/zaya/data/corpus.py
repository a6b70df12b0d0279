"""The inputs of a build: finding the files and reading them as documents.

An input is a file, a directory (searched recursively in sorted order, hidden entries skipped) or the word
`stdlib` (write `./stdlib` for a directory of that name). Three kinds of file are read:

- `.txt`: the whole file is one document or, with a document separator, each non-blank piece between
  separators is one;
- `.jsonl`: each line is a JSON object whose text field (`text` unless configured) is one document;
- `.parquet`: each row's text column is one document (needs pyarrow, an optional dependency).

`stdlib` stands for the `.py` files of the running interpreter's standard library, read like `.txt` files:
real code that every machine has, which makes it the default demo corpus. Its test suites (`test`, `tests`
and `idle_test` directories, about 60% of its bytes) and any `site-packages` are left out; what remains is
about 12 MB of source, which a two-core machine turns into a dataset in well under a minute.

Files are read in pieces that can be handled independently (byte ranges cut at record boundaries, or parquet
row groups), so a large file is spread over several worker processes. Bad text never stops a build: invalid
UTF-8 is replaced by U+FFFD and the document counted. A jsonl line that is not a JSON object with a string
text field is a bad record, returned with its position so the caller can report it by file and line.
"""

from __future__ import annotations

import itertools
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zaya.errors import ZayaError

STDLIB = "stdlib"
KINDS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
# Test suites make up most of the standard library's source; leaving them out keeps the demo corpus small.
_STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_SCAN_BYTES = 1 << 16


@dataclass(frozen=True)
class InputFile:
    """One file to read: its path, its kind ("text", "jsonl" or "parquet") and its size in bytes."""

    path: Path
    kind: str
    size: int


@dataclass(frozen=True)
class ReadOptions:
    """How documents are found inside files."""

    text_field: str = "text"
    doc_separator: str | None = None


@dataclass(frozen=True)
class Piece:
    """A part of one input file that can be read on its own.

    For text and jsonl files `start`/`stop` are byte offsets cut at record boundaries; for parquet files they
    are a range of row groups. `size` is the number of bytes on disk, for balancing work and progress."""

    file: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class Record:
    """One record of a piece: a document (`text`) or a bad record (`problem`), at `index` within the piece.

    Indices count lines of a jsonl piece, rows of a parquet piece and documents of a text piece; blank lines
    and blank documents are counted but not returned."""

    index: int
    text: str | None
    problem: str | None = None
    invalid_utf8: bool = False


@dataclass
class PieceContents:
    """The records of a piece and how many record positions it spans, for numbering the next piece."""

    records: list[Record] = field(default_factory=list)
    count: int = 0


# ---- finding the files ----------------------------------------------------------------------------------


def discover(inputs: Sequence[str | Path]) -> list[InputFile]:
    """The files named by `inputs`, in order: directories expanded in sorted order, duplicates dropped.

    Raises a `ZayaError` for a missing path, an explicitly named file of an unsupported type, a directory
    without readable files, or parquet input without pyarrow installed."""
    if not inputs:
        raise ZayaError("no inputs given: name files, directories or 'stdlib'")
    seen: set[Path] = set()
    files: list[InputFile] = []
    for item in inputs:
        for path in _expand(item):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(_input_file(path))
    return files


def stdlib_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, without test suites or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [path for path in _walk(root, _STDLIB_SKIPPED_DIRS) if path.suffix == ".py"]


def _expand(item: str | Path) -> list[Path]:
    if str(item) == STDLIB:
        return stdlib_files()
    path = Path(item)
    if path.is_dir():
        found = [p for p in _walk(path, frozenset()) if p.suffix.lower() in KINDS]
        if not found:
            raise ZayaError(f"{path}: no .txt, .jsonl or .parquet files in this directory")
        return found
    if not path.exists():
        raise ZayaError(f"{path}: no such file or directory")
    if path.suffix.lower() not in KINDS:
        raise ZayaError(f"{path}: unsupported file type '{path.suffix}' (expected .txt, .jsonl or .parquet)")
    return [path]


def _walk(root: Path, skipped_dirs: frozenset[str]) -> Iterator[Path]:
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skipped_dirs)
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(directory) / name


def _input_file(path: Path) -> InputFile:
    kind = KINDS.get(path.suffix.lower(), "text")  # stdlib's .py files are read as text
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None
    if kind == "parquet":
        _parquet_module(path)
    return InputFile(path, kind, size)


# ---- cutting files into pieces --------------------------------------------------------------------------


def split_file(file: InputFile, index: int, options: ReadOptions, target_bytes: int) -> list[Piece]:
    """Cut the file at record boundaries into pieces of about `target_bytes` (`index` is its input number)."""
    if file.kind == "parquet":
        return _parquet_pieces(file, index, options)
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
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None
    return None


def _separator_bytes(options: ReadOptions) -> bytes | None:
    return options.doc_separator.encode("utf-8") if options.doc_separator else None


# ---- reading pieces -------------------------------------------------------------------------------------


def read_piece(file: InputFile, piece: Piece, options: ReadOptions) -> PieceContents:
    """The records of one piece of `file`. Unreadable files raise a `ZayaError`; bad records do not."""
    if file.kind == "parquet":
        return _read_parquet(file, piece, options)
    with _open(file.path) as handle:
        try:
            handle.seek(piece.start)
            raw = handle.read(piece.stop - piece.start)
        except OSError as exc:
            raise ZayaError(f"{file.path}: cannot read ({exc.strerror})") from None
    if file.kind == "jsonl":
        return _jsonl_records(raw.split(b"\n"), options.text_field)
    separator = _separator_bytes(options)
    if separator is None:
        return _text_records([raw])
    parts = raw.split(separator)
    if len(parts) > 1 and not parts[-1]:
        parts.pop()  # the piece ends with a separator
    return _text_records(parts)


def location(file: InputFile, record: int, options: ReadOptions) -> str:
    """Where record number `record` (0-based, counted over the whole file) is, for messages."""
    if file.kind == "jsonl":
        return f"{file.path}:{record + 1}"
    if file.kind == "parquet":
        return f"{file.path}: row {record + 1}"
    if options.doc_separator:
        return f"{file.path}: document {record + 1}"
    return str(file.path)


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None


def _text_records(parts: list[bytes]) -> PieceContents:
    contents = PieceContents(count=len(parts))
    for index, part in enumerate(parts):
        if part and not part.isspace():
            text, invalid = _decode(part)
            contents.records.append(Record(index, text, invalid_utf8=invalid))
    return contents


def _jsonl_records(lines: list[bytes], text_field: str) -> PieceContents:
    if lines and not lines[-1]:
        lines.pop()  # the piece ends with a newline
    contents = PieceContents(count=len(lines))
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        raw, invalid = _decode(line)
        try:
            value = json.loads(raw)
        except ValueError as exc:
            contents.records.append(Record(index, None, f"not valid JSON ({exc})"))
            continue
        if not isinstance(value, dict):
            contents.records.append(Record(index, None, f"expected a JSON object, got {type(value).__name__}"))
        elif text_field not in value:
            contents.records.append(Record(index, None, f"no field '{text_field}'"))
        elif not isinstance(value[text_field], str):
            kind = type(value[text_field]).__name__
            contents.records.append(Record(index, None, f"field '{text_field}' is {kind}, not a string"))
        elif value[text_field]:
            text, bad_escape = _clean(value[text_field])
            contents.records.append(Record(index, text, invalid_utf8=invalid or bad_escape))
    return contents


def _decode(raw: bytes) -> tuple[str, bool]:
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace"), True


def _clean(text: str) -> tuple[str, bool]:
    """JSON escapes can produce lone surrogates, which are not text; they become U+FFFD like invalid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), True
    return text, False


# ---- parquet ------------------------------------------------------------------------------------------


def _parquet_module(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ZayaError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    return pq


def _parquet_file(path: Path):
    pq = _parquet_module(path)
    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) and friends for corrupt files
        raise ZayaError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0]})") from None


def _parquet_pieces(file: InputFile, index: int, options: ReadOptions) -> list[Piece]:
    parquet = _parquet_file(file.path)
    import pyarrow as pa  # present: _parquet_file checked

    schema = parquet.schema_arrow
    if options.text_field not in schema.names:
        columns = ", ".join(schema.names)
        raise ZayaError(f"{file.path}: no column '{options.text_field}' (columns: {columns})")
    column_type = schema.field(options.text_field).type
    textual = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    if not any(check(column_type) for check in textual):
        raise ZayaError(f"{file.path}: column '{options.text_field}' holds {column_type}, not text")
    metadata = parquet.metadata
    return [
        Piece(index, group, group + 1, metadata.row_group(group).total_byte_size)
        for group in range(metadata.num_row_groups)
    ]


def _read_parquet(file: InputFile, piece: Piece, options: ReadOptions) -> PieceContents:
    parquet = _parquet_file(file.path)
    values: list = []
    try:
        for group in range(piece.start, piece.stop):
            table = parquet.read_row_group(group, columns=[options.text_field])
            values.extend(table.column(0).to_pylist())
    except OSError as exc:
        raise ZayaError(f"{file.path}: cannot read ({exc.strerror or exc})") from None
    return _parquet_records(values, options.text_field)


def _parquet_records(values: Iterable[str | bytes | None], text_field: str) -> PieceContents:
    contents = PieceContents()
    for index, value in enumerate(values):
        contents.count += 1
        if value is None:
            contents.records.append(Record(index, None, f"field '{text_field}' is null"))
        elif isinstance(value, bytes):
            if value and not value.isspace():
                text, invalid = _decode(value)
                contents.records.append(Record(index, text, invalid_utf8=invalid))
        elif value:
            contents.records.append(Record(index, value))
    return contents
