"""Compressed inputs (`.gz`, `.zst`, `.zstd`): decompressed as a stream, never whole in memory.

A compressed file cannot be cut by byte range (reading from the middle needs everything before it), so it
is read as one piece, front to back, inflating at most about 1 MB at a time (16 MiB for a degenerate zstd
block), and no line or document beyond the bound for one record is held (`records.py`); a file that inflates
more than `MAX_RATIO` (2,000) times is refused as a decompression bomb. gzip files may hold several
members and zstd files several frames, as parallel compressors write them. Damage is never silent: a gzip
member is checked against its CRC, a zstd frame against its checksum when it has one (the `zstd` tool writes
them), and a file that ends inside a member or frame is truncated. Each of these is a `CorruptInput` naming
the file and the compressed offset; the readers add the last good line or document.

zstd needs the `zstandard` package, an optional dependency (`pip install 'zaya-stack[corpora]'`); gzip is in
the standard library.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Generator
from pathlib import Path
from typing import BinaryIO

from zaya.data.records import MAX_RECORD_BYTES, ChatReader, Record, json_record, split_records, text_record, too_long
from zaya.errors import ZayaError
from zaya.reading import open_regular, os_reason

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_BLOCK = 1 << 16  # compressed bytes read from the file at a time
# A gzip member's decompressor stops at _OUTPUT bytes per call and keeps the rest of its input; a zstd one
# cannot cap its output, so it is given _MAX_BLOCK bytes at a time: a zstd block of 3 bytes of header and 1 of
# content may stand for 128 KiB, so 512 bytes inflate to at most 16 MiB (real data to 2-20 KB).
_OUTPUT = 1 << 20
_MAX_BLOCK = 1 << 9
_GZIP_WINDOW = 16 + zlib.MAX_WBITS  # a gzip header and trailer around a deflate stream
# A file that inflates more than MAX_RATIO times (once past _RATIO_AFTER bytes) is refused: text compresses
# 3-10 times, and the most repetitive corpora a few hundred (the memory test's zstd shards: 655), while a zstd
# "bomb" of one repeated byte inflates 30,000 times, and reading it would cost minutes of work for no document.
# gzip cannot go beyond 1,032, so this bounds zstd files; what any file may hold in memory is bounded anyway,
# by the bound for one record (`records.py`).
MAX_RATIO = 2000
_RATIO_AFTER = 64 << 20


class CorruptInput(ZayaError):
    """A compressed file that does not decompress: damaged, truncated or not of its format."""

    def __init__(self, path: Path, compression: str, offset: int, detail: str, after: str = "") -> None:
        self.path, self.compression, self.offset, self.detail = path, compression, offset, detail
        where = f" after {after}" if after else ""
        super().__init__(f"{path}: corrupt or truncated {compression} data{where} (compressed byte {offset}): "
                         f"{detail}")

    def after(self, what: str, count: int) -> CorruptInput:
        """The same error, saying how far reading got before it went wrong ("line", 12: after line 12)."""
        return CorruptInput(self.path, self.compression, self.offset, self.detail, f"{what} {count}" if count else "")


def zstandard_module(path: Path):
    """The `zstandard` package, or a one-line error saying how to install it."""
    try:
        import zstandard
    except ImportError:
        raise ZayaError(f"{path}: reading zstd files needs the zstandard package "
                        "(pip install 'zaya-stack[corpora]')") from None
    return zstandard


def open_decompressed(path: Path, compression: str) -> BinaryIO:
    """A buffered binary stream of the file's decompressed bytes (close it when done)."""
    handle = open_regular(path, "an input")  # the returned stream owns it
    return io.BufferedReader(_Decompressor(handle, path, compression), buffer_size=1 << 20)


class _Decompressor(io.RawIOBase):
    """The decompressed bytes of a gzip or zstd file, at most about `_OUTPUT` bytes at a time."""

    def __init__(self, handle: BinaryIO, path: Path, compression: str) -> None:
        self._handle, self._path, self._compression = handle, path, compression
        self._zstd = zstandard_module(path).ZstdDecompressor() if compression == "zstd" else None
        self._unit = None  # the decompressor of the current gzip member or zstd frame
        self._input = memoryview(b"")  # compressed bytes read but not yet decompressed
        self._pending = memoryview(b"")  # decompressed bytes not yet handed out
        self._position = 0  # compressed bytes read
        self._produced = 0  # decompressed bytes made

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            if not self._decompress_more():
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]  # a view: no copy of what remains
        return count

    def close(self) -> None:
        self._handle.close()
        super().close()

    def _decompress_more(self) -> bool:
        """Decompress some more into `_pending`; False at the clean end of the file."""
        while True:
            if not self._input:
                try:
                    block = self._handle.read(_BLOCK)
                except OSError as exc:
                    raise ZayaError(f"{self._path}: cannot read ({os_reason(exc)})") from None
                if not block:
                    return self._drain()
                self._position += len(block)
                self._input = memoryview(block)
            if self._unit is None:
                self._unit = self._new_unit()
            given = self._input
            try:
                if self._zstd is not None:
                    fed = len(given[:_MAX_BLOCK])
                    out = self._unit.decompress(given[:fed])
                    left = len(self._unit.unused_data) if self._unit.eof else 0  # the next frame's start
                    self._input = given[fed - left:]
                else:
                    out = self._unit.decompress(given, _OUTPUT)
                    left = self._unit.unused_data if self._unit.eof else self._unit.unconsumed_tail
                    self._input = given[len(given) - len(left):]  # what is left is the input's tail: no copy
            except Exception as exc:  # zlib.error, zstandard.ZstdError: damaged data
                raise self._corrupt(str(exc)) from None
            if self._unit.eof:
                self._unit = None
            if out:
                self._handed(out)
                return True

    def _drain(self) -> bool:
        """At the end of the file: what a gzip member still holds back, or the end (truncated inside a unit)."""
        if self._unit is None:
            return False
        if self._zstd is None:
            try:
                out = self._unit.decompress(b"", _OUTPUT)
            except Exception as exc:
                raise self._corrupt(str(exc)) from None
            if self._unit.eof:
                self._unit = None
            if out:
                self._handed(out)
                return True
            if self._unit is None:
                return False
        unit = "member" if self._compression == "gzip" else "frame"
        raise self._corrupt(f"the file ends inside a {unit}")

    def _handed(self, out: bytes) -> None:
        self._produced += len(out)
        consumed = self._position - len(self._input)
        if self._produced > _RATIO_AFTER and self._produced > MAX_RATIO * consumed:
            raise ZayaError(f"{self._path}: inflates more than {MAX_RATIO} times ({self._produced:,} bytes from "
                            f"{consumed:,}), the limit for a compressed input; refusing it as a decompression bomb")
        self._pending = memoryview(out)

    def _new_unit(self):
        if self._zstd is not None:
            return self._zstd.decompressobj()
        return zlib.decompressobj(_GZIP_WINDOW)

    def _corrupt(self, detail: str) -> CorruptInput:
        return CorruptInput(self._path, self._compression, self._position, detail)


# ---- reading decompressed records -----------------------------------------------------------------------


def jsonl_stream(path: Path, compression: str, text_field: str, chat: ChatReader | None = None,
                 limit: int = MAX_RECORD_BYTES) -> Generator[Record, None, int]:
    """The records of a compressed JSON-lines file, line by line (chats with a `chat` format); a line over
    `limit` bytes is a bad record, skipped unread. Returns the number of lines."""
    index = 0
    with open_decompressed(path, compression) as stream:
        try:
            for line in split_records(stream.read, b"\n", limit):
                if line is None:
                    record = too_long(index, "a chat" if chat is not None else "a line", limit)
                else:
                    record = json_record(index, line, text_field, chat)
                if record is not None:
                    yield record
                index += 1
        except CorruptInput as exc:
            raise exc.after("line", index) from None
    return index


def text_stream(path: Path, compression: str, separator: bytes | None,
                limit: int = MAX_RECORD_BYTES) -> Generator[Record, None, int]:
    """The documents of a compressed text file: the whole file, or each piece between separators (read a
    block at a time, holding one document at most); a document over `limit` bytes is a bad record, skipped
    unread. Returns the number of documents."""
    index = 0
    with open_decompressed(path, compression) as stream:
        try:
            if separator is None:
                raw = stream.read(limit + 1)
                record = too_long(0, "a document", limit) if len(raw) > limit else text_record(0, raw)
                if record is not None:
                    yield record
                return 1
            for raw in split_records(stream.read, separator, limit, keep_lone_empty=True):
                record = too_long(index, "a document", limit) if raw is None else text_record(index, raw)
                if record is not None:
                    yield record
                index += 1
        except CorruptInput as exc:
            raise exc.after("document", index) from None
    return index
