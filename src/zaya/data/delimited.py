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

from zaya.data.records import Record
from zaya.errors import ZayaError

DELIMITERS = {"csv": ",", "tsv": "\t"}
# cells may be whole documents, far beyond the parser's default limit of 128 KB
_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)


def header_column(stream: BinaryIO, path: Path, kind: str, text_field: str) -> int:
    """The index of the text column in the header row; a `ZayaError` if there is none."""
    with _rows(stream, kind) as rows:
        try:
            header = next(rows, None)
        except csv.Error as exc:
            raise ZayaError(f"{path}:1: not a readable {kind.upper()} header ({exc})") from None
    return _column(path, header, text_field)


def delimited_stream(stream: BinaryIO, path: Path, kind: str, text_field: str) -> Generator[Record, None, int]:
    """The documents of a CSV or TSV file. Record indices count lines before the record, so that messages
    name the line it starts on; returns the number of lines."""
    with _rows(stream, kind) as rows:
        try:
            header = next(rows, None)
            column = _column(path, header, text_field)
            lines = rows.line_num
            for row in rows:
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
        raise ZayaError(f"{path}: no column '{text_field}' (columns: {', '.join(header)})")
    return header.index(text_field)


@contextlib.contextmanager
def _rows(stream: BinaryIO, kind: str) -> Iterator:
    """A CSV reader over a binary stream. Undecodable bytes pass through as surrogates, so a bad byte in one
    cell does not stop the file, and the parser's field size limit (process-wide, hence restored after)
    is lifted while it reads."""
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="")
    previous = csv.field_size_limit(_FIELD_LIMIT)
    try:
        yield csv.reader(text, delimiter=DELIMITERS[kind])
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
