"""Compressed inputs (`.gz`, `.zst`, `.zstd`): decompressed as a stream, never whole in memory.

A compressed file cannot be cut by byte range (reading from the middle needs everything before it), so it
is read as one piece, front to back, a block at a time (each inflating to about 1 MB). gzip files may hold several
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

from zaya.data.records import ChatReader, Record, json_record, text_record
from zaya.errors import ZayaError

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# Compressed bytes are read in blocks sized so that each inflates to about _OUTPUT bytes: text compressed
# 4:1 is read 256 KB at a time, and a file of repeated lines compressed 1000:1 a kilobyte at a time, so no
# read ever produces more than a few MB (neither decompressor can cap its output itself).
_BLOCK = 1 << 14  # the first block
_MIN_BLOCK = 1 << 10
_MAX_BLOCK = 1 << 18
_OUTPUT = 1 << 20
_GZIP_WINDOW = 16 + zlib.MAX_WBITS  # a gzip header and trailer around a deflate stream


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
    try:
        handle = open(path, "rb")  # noqa: SIM115 - the returned stream owns it
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror})") from None
    return io.BufferedReader(_Decompressor(handle, path, compression), buffer_size=1 << 20)


class _Decompressor(io.RawIOBase):
    """The decompressed bytes of a gzip or zstd file, one compressed block at a time."""

    def __init__(self, handle: BinaryIO, path: Path, compression: str) -> None:
        self._handle, self._path, self._compression = handle, path, compression
        self._zstd = zstandard_module(path).ZstdDecompressor() if compression == "zstd" else None
        self._unit = None  # the decompressor of the current gzip member or zstd frame
        self._pending = memoryview(b"")  # decompressed bytes not yet handed out
        self._position = 0  # compressed bytes consumed
        self._block = _BLOCK

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
        """Decompress the next block into `_pending`; False at the clean end of the file."""
        try:
            block = self._handle.read(self._block)
        except OSError as exc:
            raise ZayaError(f"{self._path}: cannot read ({exc.strerror})") from None
        if not block:
            if self._unit is not None:
                unit = "member" if self._compression == "gzip" else "frame"
                raise self._corrupt(f"the file ends inside a {unit}")
            return False
        self._position += len(block)
        parts = []
        while block:
            if self._unit is None:
                self._unit = self._new_unit()
            try:
                parts.append(self._unit.decompress(block))
            except Exception as exc:  # zlib.error, zstandard.ZstdError: damaged data
                raise self._corrupt(str(exc)) from None
            if not self._unit.eof:
                break
            block = self._unit.unused_data  # the next member or frame starts in this block
            self._unit = None
        self._pending = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
        produced = max(1, len(self._pending))
        self._block = min(_MAX_BLOCK, max(_MIN_BLOCK, self._block * _OUTPUT // produced))
        return True

    def _new_unit(self):
        if self._zstd is not None:
            return self._zstd.decompressobj()
        return zlib.decompressobj(_GZIP_WINDOW)

    def _corrupt(self, detail: str) -> CorruptInput:
        return CorruptInput(self._path, self._compression, self._position, detail)


# ---- reading decompressed records -----------------------------------------------------------------------


def jsonl_stream(path: Path, compression: str, text_field: str,
                 chat: ChatReader | None = None) -> Generator[Record, None, int]:
    """The records of a compressed JSON-lines file, line by line (chats with a `chat` format); returns the
    number of lines."""
    index = 0
    with open_decompressed(path, compression) as stream:
        try:
            for line in stream:
                record = json_record(index, line, text_field, chat)
                if record is not None:
                    yield record
                index += 1
        except CorruptInput as exc:
            raise exc.after("line", index) from None
    return index


def text_stream(path: Path, compression: str, separator: bytes | None) -> Generator[Record, None, int]:
    """The documents of a compressed text file: the whole file, or each piece between separators (read a
    block at a time, holding one document at most); returns the number of documents."""
    index = 0
    with open_decompressed(path, compression) as stream:
        try:
            if separator is None:
                record = text_record(0, stream.read())
                if record is not None:
                    yield record
                return 1
            buffer = bytearray()
            while block := stream.read(1 << 20):
                # a separator may straddle two blocks: search again from just before the new one
                search = max(0, len(buffer) - len(separator) + 1)
                buffer += block
                cut = 0
                while (found := buffer.find(separator, max(search, cut))) >= 0:
                    record = text_record(index, bytes(buffer[cut:found]))
                    if record is not None:
                        yield record
                    index += 1
                    cut = found + len(separator)
                del buffer[:cut]
        except CorruptInput as exc:
            raise exc.after("document", index) from None
    if buffer or index == 0:  # as in a plain file, a final separator does not start an empty document
        record = text_record(index, bytes(buffer))
        if record is not None:
            yield record
        index += 1
    return index
