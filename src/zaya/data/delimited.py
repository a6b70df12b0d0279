"""`.csv` and `.tsv` files: a header row naming the columns, then one record per row; the text column's
cell is a document.

This reads what `datasets.load_dataset("csv", ...)` reads from a file with a header, with the standard
library's parser: quoted cells may hold the delimiter, doubled quotes and newlines, so one record can span
several lines (which is also why a file is one streamed piece: without reading from the start there is no
telling whether a newline ends a record). Cells are taken as text exactly as written, never converted to
numbers; an empty cell, like an empty string anywhere, is no document. A row too short to have the text
column is a bad record, reported as `FILE:LINE` (the line the record starts on); a parse error stops the
build at its line. Invalid UTF-8 becomes U+FFFD, as in every other kind of input.
"""

from __future__ import annotations

import contextlib
import csv
import io
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import BinaryIO

from zaya.data.records import MAX_RECORD_BYTES, Record
from zaya.errors import ZayaError

_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)

DELIMITERS = {"csv": ",", "tsv": "\t"}
# A row may have at most this many fields: a row of a million empty cells costs 8 MB of pointers, and a cell of
# two characters 50 bytes, so no bound on the row's size alone keeps it small. (Counted as the delimiters outside
# quotes, a little generously where a quote appears inside an unquoted cell.)
MAX_FIELDS = 1 << 20


def header_column(stream: BinaryIO, path: Path, kind: str, text_field: str, limit: int = MAX_RECORD_BYTES) -> int:
    """The index of the text column in the header row; a `ZayaError` if there is none."""
    with _rows(stream, kind, path, limit) as (rows, _):
        try:
            header = next(rows, None)
        except csv.Error as exc:
            raise ZayaError(f"{path}:1: not a readable {kind.upper()} header ({exc})") from None
    return _column(path, header, text_field)


def delimited_stream(stream: BinaryIO, path: Path, kind: str, text_field: str,
                     limit: int = MAX_RECORD_BYTES) -> Generator[Record, None, int]:
    """The documents of a CSV or TSV file. Record indices count lines before the record, so that messages
    name the line it starts on; returns the number of lines. A row over `limit` characters or `MAX_FIELDS`
    fields stops the build at its line (the parser cannot skip it: whether a newline ends a row depends on
    what came before)."""
    with _rows(stream, kind, path, limit) as (rows, lines_read):
        try:
            header = next(rows, None)
            column = _column(path, header, text_field)
            lines = rows.line_num
            lines_read.row_done()
            for row in rows:
                lines_read.row_done()
                if len(row) > column:
                    text, invalid = _restored(row[column])
                    if text:
                        yield Record(lines, text, invalid_utf8=invalid)
                elif row:
                    yield Record(lines, None, f"no field '{text_field}' (the row has {len(row)} of the header's "
                                              f"{len(header)} fields)")
                lines = rows.line_num
        except csv.Error as exc:
            raise ZayaError(f"{path}:{rows.line_num}: not readable as {kind.upper()} ({exc})") from None
    return lines


def _column(path: Path, header: list[str] | None, text_field: str) -> int:
    if header is None:
        raise ZayaError(f"{path}: empty file, no header row")
    if text_field not in header:
        shown = ", ".join(name if len(name) <= 60 else name[:57] + "..." for name in header[:50])
        more = f" and {len(header) - 50} more" if len(header) > 50 else ""
        raise ZayaError(f"{path}: no column '{text_field}' (columns: {shown}{more})")
    return header.index(text_field)


class _Lines:
    """The lines of a text stream for the CSV parser, each read with a bound: a row (one line or several, when a
    quoted cell holds newlines) of more than `limit` characters or `MAX_FIELDS` fields stops the file with one
    line naming where, before it is held. `row_done` starts the count of the next row."""

    def __init__(self, text: io.TextIOBase, path: Path, kind: str, limit: int) -> None:
        self.text, self.path, self.kind, self.limit = text, path, kind, limit
        self.delimiter = DELIMITERS[kind]
        self.line = 0
        self.row_start = 1
        self.row_chars = 0
        self.row_fields = 1
        self.quoted = False  # inside a quoted cell at the end of the last line read

    def row_done(self) -> None:
        self.row_start, self.row_chars, self.row_fields, self.quoted = self.line + 1, 0, 1, False

    def __iter__(self) -> Iterator[str]:
        while line := self.text.readline(self.limit - self.row_chars + 1):
            self.line += 1
            self.row_chars += len(line)
            parts = line.split('"')
            outside = parts[1::2] if self.quoted else parts[::2]
            self.row_fields += sum(part.count(self.delimiter) for part in outside)
            self.quoted ^= len(parts) % 2 == 0
            if self.row_chars > self.limit:
                raise ZayaError(f"{self.path}:{self.row_start}: a row of more than {self.limit:,} characters (the "
                                "limit for one record)")
            if self.row_fields > MAX_FIELDS:
                raise ZayaError(f"{self.path}:{self.row_start}: a row of more than {MAX_FIELDS:,} fields (the limit "
                                f"for one {self.kind.upper()} row)")
            yield line


@contextlib.contextmanager
def _rows(stream: BinaryIO, kind: str, path: Path, limit: int) -> Iterator:
    """A CSV reader over a binary stream, and its `_Lines`. Undecodable bytes pass through as surrogates, so a
    bad byte in one cell does not stop the file, and the parser's field size limit (process-wide, hence
    restored after) is the bound for one record while it reads."""
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="")
    lines = _Lines(text, path, kind, limit)
    previous = csv.field_size_limit(min(limit, _FIELD_LIMIT))
    try:
        yield csv.reader(lines, delimiter=DELIMITERS[kind]), lines
    finally:
        csv.field_size_limit(previous)
        text.detach()  # the caller owns the stream


def _restored(cell: str) -> tuple[str, bool]:
    """A cell as text, and whether it held invalid UTF-8: the bytes the surrogates stand for are decoded again
    with replacement, exactly as a plain text file's would be."""
    try:
        cell.encode("utf-8")
    except UnicodeEncodeError:
        return cell.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), True
    return cell, False
