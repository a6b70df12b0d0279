"""What every reader of a build's inputs produces: pieces of files, and the records read from them.

A reader turns a piece of an input file into `Record`s: documents, or bad records with what is wrong and
where. The checks that decide which is which live here, shared by every format, so that the same document
reads the same whether it comes from a `.jsonl` line, a JSON array, a parquet or arrow row or a CSV cell:

- a text value is a document unless it is empty; raw bytes (plain text files, binary columns) must also not be
  only whitespace;
- invalid UTF-8 and the lone surrogates JSON escapes can produce become U+FFFD, and the document is flagged;
- a JSON record must be an object whose text field is a string (a record without one carries the fields it
  has, so that the build can say which `--text-field` would read it); a column value must not be null;
- a chat record (`zaya data build --format chat`) must be an object whose `messages` the chat template can
  render (`chat.py` checks them); its document is the rendered text, with the assistant turns' spans;
- no record is held in memory beyond a bound: a document, a line, a JSON element, a CSV row or a table cell of
  more than `MAX_RECORD_BYTES` (64 MiB), a chat of more than `MAX_CHAT_BYTES` (16 MiB) or `MAX_CHAT_TURNS`
  (10,000) messages, is a bad record whose bytes are skipped as they are read (`split_records`), never held
  whole.

The bounds are far beyond what corpora hold (a whole book is a few MB; The Stack leaves out source files over
1 MB; the longest Wikipedia articles are about 1 MB of wikitext) and keep a worker's memory bounded: the encoder
needs tens of bytes per character of what it is given at once, so a document is tokenized in parts, but the
document itself, its UTF-8 copy and its parts are held while it is.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from zaya.reading import size_text

MiB = 1 << 20
MAX_RECORD_BYTES = 64 * MiB  # one document, line, JSON element, CSV row or table cell, as stored
MAX_CHAT_BYTES = 16 * MiB  # one chat record (its JSON, or its messages' text in a table)
MAX_CHAT_TURNS = 10_000  # messages in one chat
_BLOCK = 1 << 20  # bytes read at a time by `split_records`
_SHOWN_FIELDS = 8
_FIELD_CHARS = 40
CHAT_FIELD = "messages"


@dataclass(frozen=True)
class InputFile:
    """One file to read: its path, its kind, its size in bytes on disk and how it is compressed.

    Kinds are "text", "jsonl", "json" (a JSON array of objects), "csv", "tsv", "parquet" and "arrow";
    `compression` is None, "gzip" or "zstd"."""

    path: Path
    kind: str
    size: int
    compression: str | None = None


class ChatReader(Protocol):
    """What makes a chat record's document (`chat.ChatFormat`, which imports this module)."""

    def record(self, index: int, value: dict, invalid_utf8: bool = False) -> Record: ...


@dataclass(frozen=True)
class ReadOptions:
    """How documents are found inside files."""

    text_field: str = "text"
    doc_separator: str | None = None
    chat: ChatReader | None = None  # JSON records are chats, rendered by this (a `chat.ChatFormat`)

    @property
    def record_limit(self) -> int:
        """The most bytes one record may hold (`MAX_CHAT_BYTES` for chats, else `MAX_RECORD_BYTES`)."""
        return MAX_CHAT_BYTES if self.chat is not None else MAX_RECORD_BYTES


@dataclass(frozen=True)
class Piece:
    """A part of one input file that can be read on its own.

    For plain text and jsonl files `start`/`stop` are byte offsets cut at record boundaries; for parquet files
    a range of row groups, for arrow files a range of record batches; a streamed file (compressed, CSV, a JSON
    array) is one piece from 0 to its size. `size` is the number of bytes on disk, for balancing work and
    progress."""

    file: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class Record:
    """One record of a piece: a document (`text`) or a bad record (`problem`), at `index` within the piece.

    Indices count lines of a jsonl piece, rows of a table or CSV piece, elements of a JSON array and documents
    of a text piece; blank records are counted but not returned. A chat's document has `spans`: the character
    ranges [start, stop) of `text` that the model learns to produce. A `fatal` problem stops the build even
    without --strict: it is not the record's (a chat template that runs past its budget)."""

    index: int
    text: str | None
    problem: str | None = None
    invalid_utf8: bool = False
    spans: tuple[tuple[int, int], ...] | None = None
    fatal: bool = False
    fields: tuple[str, ...] | None = None  # a record without the text field: the fields it has (`fields_of`)


@dataclass
class PieceContents:
    """The records of a piece and how many record positions it spans, for numbering the next piece."""

    records: list[Record] = field(default_factory=list)
    count: int = 0


class RecordStream:
    """The records of a piece, read lazily from a generator that returns the piece's record count.

    Iterate it once; `count` is final when the iteration ends. Breaking off early closes the generator, and
    with it the file it reads."""

    def __init__(self, records: Generator[Record, None, int]) -> None:
        self._records = records
        self.count = 0

    def __iter__(self) -> Iterator[Record]:
        self.count = yield from self._records

    def close(self) -> None:
        """Stop reading and release the file."""
        self._records.close()


def decode(raw: bytes) -> tuple[str, bool]:
    """Bytes as text, and whether they held invalid UTF-8 (replaced by U+FFFD)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace"), True


def clean(text: str) -> tuple[str, bool]:
    """Text without surrogates, and whether it had some.

    JSON escapes can produce lone surrogates, and text decoded with `surrogateescape` holds invalid UTF-8 as
    surrogates; neither is text, so both become U+FFFD, exactly as decoding the raw bytes would."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), True
    return text, False


def too_long(index: int, what: str, limit: int) -> Record:
    """The bad record of something over its bound (`what`: "a line", "a document", ...)."""
    return Record(index, None, f"{what} of more than {size_text(limit)} (the limit for one record)")


def split_records(read: Callable[[int], bytes], separator: bytes, limit: int, *,
                  keep_lone_empty: bool = False) -> Iterator[bytes | None]:
    """The records of a byte stream (`read(n)` gives its next bytes, b"" at its end) cut at `separator`, without
    it; a record longer than `limit` bytes is None, its bytes skipped as they are read, never held. A last
    record that is empty is left out, unless it is the only one and `keep_lone_empty` (a text file's one
    document). At most `limit` + one block are held at a time."""
    buffer = bytearray()
    skipping = False
    count = 0
    reach = limit + len(separator) - 1  # a record of `limit` bytes may be followed by part of a separator
    while block := read(_BLOCK):
        search = max(0, len(buffer) - len(separator) + 1)  # a separator may straddle two blocks
        buffer += block
        cut = 0
        while (found := buffer.find(separator, max(search, cut))) >= 0:
            yield None if skipping or found - cut > limit else bytes(buffer[cut:found])
            count += 1
            skipping = False
            cut = found + len(separator)
        del buffer[:cut]
        if len(buffer) > reach:
            skipping = True
            del buffer[:len(buffer) - len(separator) + 1]
    if skipping or buffer or (count == 0 and keep_lone_empty):
        yield None if skipping or len(buffer) > limit else bytes(buffer)


def text_record(index: int, raw: bytes) -> Record | None:
    """A document of raw bytes, or None if it is blank."""
    if not raw or raw.isspace():
        return None
    text, invalid = decode(raw)
    return Record(index, text, invalid_utf8=invalid)


def object_record(index: int, value: Any, text_field: str, invalid_utf8: bool = False,
                  chat: ChatReader | None = None) -> Record | None:
    """The document of one parsed JSON value (a bad record unless an object with a string text field, or with
    `chat` a chat's messages), or None for an empty text. `invalid_utf8` says the JSON source already had
    invalid UTF-8."""
    if not isinstance(value, dict):
        return Record(index, None, f"expected a JSON object, got {type(value).__name__}")
    if chat is not None:
        if CHAT_FIELD not in value:  # (the chat reader says so too, without the fields there are)
            return Record(index, None, f"no field '{CHAT_FIELD}'", fields=fields_of(value))
        return chat.record(index, value, invalid_utf8)
    if text_field not in value:
        return Record(index, None, f"no field '{text_field}'", fields=fields_of(value))
    text = value[text_field]
    if not isinstance(text, str):
        return Record(index, None, f"field '{text_field}' is {type(text).__name__}, not a string")
    if not text:
        return None
    text, bad_escape = clean(text)
    return Record(index, text, invalid_utf8=invalid_utf8 or bad_escape)


def fields_of(value: dict) -> tuple[str, ...]:
    """The fields of a record that lacks the one looked for, as a line may show them (the first few, each on one
    line and cut short): the build names the most common set with the flag that reads them."""
    names = []
    for key in itertools.islice(value, _SHOWN_FIELDS):
        name = key if key.isprintable() else json.dumps(key)[1:-1]  # one line, always
        names.append(name if len(name) <= _FIELD_CHARS else name[:_FIELD_CHARS - 3] + "...")
    if len(value) > _SHOWN_FIELDS:
        names.append(f"{len(value) - _SHOWN_FIELDS:,} more")
    return tuple(names)


def json_record(index: int, raw: bytes, text_field: str, chat: ChatReader | None = None) -> Record | None:
    """The document of one JSON text (a jsonl line or an array element), a bad record, or None if blank."""
    if not raw.strip():
        return None
    source, invalid = decode(raw)
    try:
        value = json.loads(source)
    except ValueError as exc:
        return Record(index, None, f"not valid JSON ({exc})")
    except RecursionError:
        return Record(index, None, "not valid JSON (nested too deeply)")
    return object_record(index, value, text_field, invalid, chat)


def column_record(index: int, value: str | bytes | None, text_field: str) -> Record | None:
    """The document of one table cell: a bad record if null, None if empty."""
    if value is None:
        return Record(index, None, f"field '{text_field}' is null")
    if isinstance(value, bytes):
        return text_record(index, value)
    if not value:
        return None
    text, invalid = clean(value)
    return Record(index, text, invalid_utf8=invalid)
