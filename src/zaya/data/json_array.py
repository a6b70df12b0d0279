"""`.json` files: a JSON array of objects, read element by element, or JSON lines.

`datasets.load_dataset("json", ...)` reads both: JSON lines, and a file holding one array of objects. A
`.json` file whose first non-blank byte is `[` is an array, anything starting with `{` JSON lines (read like
`.jsonl`). An array is scanned as a stream: a scanner follows strings and nesting with two regular
expressions, so only the element being read is held in memory, and each element is parsed on its own. An
element that is not an object with a string text field is a bad record, reported as `FILE: element N`; an
array whose brackets do not balance, or that is not closed when the file ends, stops the build.

An array cannot be cut at record boundaries without reading it from its start, so it is one streamed piece.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from pathlib import Path
from typing import BinaryIO

from zaya.data.records import MAX_RECORD_BYTES, ChatReader, Record, json_record, too_long
from zaya.errors import ZayaError

_STRUCTURE = re.compile(rb'[\[\]{}",]')  # what matters outside strings
_IN_STRING = re.compile(rb'["\\]')  # what matters inside one
_BLOCK = 1 << 20
_SNIFF = 1 << 12


def sniff(stream: BinaryIO, path: Path) -> str:
    """"json" (an array) or "jsonl" (JSON lines, or nothing at all), from the first non-blank byte."""
    while block := stream.read(_SNIFF):
        first = block.lstrip()[:1]
        if first == b"[":
            return "json"
        if first == b"{":
            return "jsonl"
        if first:
            raise ZayaError(f"{path}: not a JSON array or JSON lines (starts with {first!r})")
    return "jsonl"


def array_stream(stream: BinaryIO, path: Path, text_field: str, chat: ChatReader | None = None,
                 limit: int = MAX_RECORD_BYTES) -> Generator[Record, None, int]:
    """The elements of a JSON array as records (chats with a `chat` format); an element over `limit` bytes is a
    bad record, scanned but not held. Returns the number of elements."""
    scanner = _Scanner(stream, path, limit)
    index = 0
    for raw in scanner.elements():
        if raw is None:
            record = too_long(index, "a chat" if chat is not None else "an element", limit)
        elif raw.strip():
            record = json_record(index, raw, text_field, chat)
        else:
            record = Record(index, None, "not valid JSON (an empty element)")
        if record is not None:
            yield record
        index += 1
    return index


class _Scanner:
    """Finds the top-level elements of a JSON array in a byte stream, block by block."""

    def __init__(self, stream: BinaryIO, path: Path, limit: int = MAX_RECORD_BYTES) -> None:
        self.stream, self.path, self.limit = stream, path, limit
        self.buffer = bytearray()
        self.dropped = 0  # bytes removed from the front of the buffer, for offsets in messages

    def elements(self) -> Generator[bytes | None, None, None]:
        """The raw bytes of each element, separators and brackets excluded; None for an element over the limit
        (its bytes are scanned as they come, and dropped)."""
        pos, depth, in_string, start, seen = 0, 0, False, 0, 0
        skipping = False
        while True:
            match = (_IN_STRING if in_string else _STRUCTURE).search(self.buffer, pos)
            if match is not None and in_string and match.group() == b"\\" and match.end() == len(self.buffer):
                match, pos = None, len(self.buffer) - 1  # the escaped character is in the next block
            elif match is None:
                pos = len(self.buffer)
            if match is None:
                if depth and not skipping and pos - start > self.limit:
                    skipping = True
                # inside the array, the element being read stays (unless it is too long to keep)
                keep = start if depth and not skipping else pos
                if not depth and self.buffer[:keep].strip():
                    raise self._error("not a JSON array", 0)
                if not self._more(keep):
                    if depth:
                        raise ZayaError(f"{self.path}: the JSON array is not closed (truncated?) after element "
                                        f"{seen}")
                    raise ZayaError(f"{self.path}: no JSON array in the file")
                pos, start = pos - keep, start - keep
                continue
            char, pos = match.group(), match.end()
            if in_string:
                if char == b"\\":
                    pos += 1  # skip the escaped character, which may be a quote
                else:
                    in_string = False
            elif depth == 0:
                if char != b"[" or self.buffer[:match.start()].strip():
                    raise self._error("not a JSON array", match.start())
                depth, start = 1, pos
            elif char == b'"':
                in_string = True
            elif depth == 1 and char in b",]":
                if skipping or match.start() - start > self.limit:
                    yield None
                    seen += 1
                else:
                    raw = bytes(self.buffer[start:match.start()])
                    if char == b"," or raw.strip() or seen:  # only `[]` has no element
                        yield raw
                        seen += 1
                skipping = False
                start = pos
                if char == b"]":
                    break
            elif char in b"[{":
                depth += 1
            elif char in b"]}":
                if depth == 1:
                    raise self._error(f"unbalanced {char.decode()!r}", match.start())
                depth -= 1
        rest, offset = self.buffer[pos:], self.dropped + pos
        while rest:  # nothing but blanks may follow the array
            if rest.strip():
                raise ZayaError(f"{self.path}: data after the end of the array at byte "
                                f"{offset + len(rest) - len(rest.lstrip())}")
            offset += len(rest)
            rest = self.stream.read(_BLOCK)

    def _more(self, keep: int) -> bool:
        """Drop the buffer's first `keep` bytes and read another block; False at the end of the file."""
        del self.buffer[:keep]
        self.dropped += keep
        block = self.stream.read(_BLOCK)
        self.buffer += block
        return bool(block)

    def _error(self, what: str, position: int) -> ZayaError:
        return ZayaError(f"{self.path}: {what} at byte {self.dropped + position}")
