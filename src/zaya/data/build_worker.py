"""The worker side of `zaya data build`: a unit of work's records read, their documents tokenized a buffer at a
time, and the tokens spilled to the staging directory; only sizes, counts, the first problems and the bad
records counted by reason go back to the main process. A chat's tokens also get their loss mask, from the
encoder's character offsets."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from zaya.data.chat import span_mask
from zaya.data.corpus import InputFile, Piece, ReadOptions, stream_piece
from zaya.data.shards import SPLITS
from zaya.data.skipped import count_reason, reason_of
from zaya.data.spill import SpilledTokens, SpillWriter

MAX_REPORTED_PROBLEMS = 100
# Long documents are tokenized in parts: the encoder needs tens of bytes per character of what it is given.
_PART_CHARS = 1 << 18
# a worker tokenizes this much text at a time, in encode calls of _ENCODE_CHARS characters: the encoder's
# per-token objects cost it tens of bytes per character, so larger calls only cost memory
_BUFFER_BYTES = 1 << 21
_ENCODE_CHARS = 1 << 18


def is_val(data: bytes, fraction: float) -> bool:
    """Whether a document is held out: a hash of its text against the fraction, stable across builds."""
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return digest < fraction * 2.0**64


@dataclass(frozen=True)
class Job:
    """One unit of work for a worker process: a few pieces, and all it needs to tokenize them."""

    tokenizer_json: bytes
    eos_id: int
    dtype: str
    val_fraction: float
    strict: bool
    read: ReadOptions
    files: tuple[InputFile, ...]  # the input file of each piece
    pieces: tuple[Piece, ...]
    spill: str  # where the job's tokens go: a path prefix in the staging directory


@dataclass
class JobResult:
    tokens: SpilledTokens
    counts: list[int] = field(default_factory=list)  # record positions spanned by each piece
    # the first MAX_REPORTED_PROBLEMS of each, as (piece, record within the piece[, what is wrong])
    problems: list[tuple[int, int, str]] = field(default_factory=list)
    invalid_utf8: list[tuple[int, int]] = field(default_factory=list)
    bad_records: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # bad records by reason (`skipped.reason_of`), bounded
    invalid_utf8_documents: int = 0
    text_bytes: int = 0
    # what stops the build: --strict's first bad record, or a chat template past its budget
    fatal: tuple[int, int, str] | None = None


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(tokenizer_json: bytes) -> Tokenizer:
    # every job carries the tokenizer; a worker parses it once and reuses it for the jobs that follow
    return Tokenizer.from_str(tokenizer_json.decode("utf-8"))


def encode_job(job: Job) -> JobResult:
    """Read a job's pieces record by record, tokenize them a buffer at a time, and append the tokens to the
    job's files; what returns to the main process is sizes, counts and the first few problems."""
    spill = SpillWriter(job.spill, job.dtype, masked=job.read.chat is not None)
    result = JobResult(spill.spilled)
    buffer = _Buffer()
    try:
        for i, (file, piece) in enumerate(zip(job.files, job.pieces, strict=True)):
            stream = stream_piece(file, piece, job.read)
            for record in stream:
                if record.text is None:
                    if job.strict or record.fatal:
                        result.fatal = (i, record.index, record.problem)
                        return result
                    result.bad_records += 1
                    count_reason(result.reasons, reason_of(record.problem, record.fields))
                    if len(result.problems) < MAX_REPORTED_PROBLEMS:
                        result.problems.append((i, record.index, record.problem))
                    continue
                if record.invalid_utf8:
                    result.invalid_utf8_documents += 1
                    if len(result.invalid_utf8) < MAX_REPORTED_PROBLEMS:
                        result.invalid_utf8.append((i, record.index))
                data = record.text.encode("utf-8")
                result.text_bytes += len(data)
                buffer.add("val" if is_val(data, job.val_fraction) else "train", record.text, len(data),
                           record.spans)
                if buffer.bytes >= _BUFFER_BYTES:
                    buffer.flush(job, spill)
            result.counts.append(stream.count)
        buffer.flush(job, spill)
    finally:
        spill.close()
    return result


@dataclass
class _Buffer:
    """A worker's documents waiting to be tokenized, per split."""

    texts: dict[str, list[str]] = field(default_factory=lambda: {split: [] for split in SPLITS})
    spans: dict[str, list] = field(default_factory=lambda: {split: [] for split in SPLITS})
    bytes: int = 0

    def add(self, split: str, text: str, size: int, spans: tuple[tuple[int, int], ...] | None = None) -> None:
        self.texts[split].append(text)
        self.spans[split].append(spans)
        self.bytes += size

    def flush(self, job: Job, spill: SpillWriter) -> None:
        """Tokenize what is buffered and append it to the job's files."""
        tokenizer = _worker_tokenizer(job.tokenizer_json)
        for split, documents in self.texts.items():
            if documents:
                spans = self.spans[split] if job.read.chat is not None else None
                spill.write(split, *_encode(tokenizer, documents, job.eos_id, job.dtype, spans))
            documents.clear()
            self.spans[split].clear()
        self.bytes = 0


def _encode(tokenizer: Tokenizer, documents: list[str], eos_id: int, dtype: str,
            spans: list[tuple[tuple[int, int], ...]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Documents to one token array (each followed by `eos_id`), the documents' lengths and, given each
    document's `spans`, the loss mask: 1 for the tokens that overlap a span, 0 elsewhere and for eos.

    The encoder is called on about `_ENCODE_CHARS` of text at a time and its results become arrays at once:
    its per-token objects, and Python's per-id integers, would otherwise outweigh the text many times."""
    parts, owners, starts = [], [], []
    for d, text in enumerate(documents):
        start = 0
        for part in _parts(text):
            parts.append(part)
            owners.append(d)
            starts.append(start)  # a part's offsets count from its own start
            start += len(part)
    if spans is None:
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster, same ids
    else:
        encode = tokenizer.encode_batch
    eos = np.array([eos_id], dtype=np.uint32)
    arrays: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths = np.zeros(len(documents), dtype=np.int64)
    start = 0
    while start < len(parts):
        stop, chars = start, 0
        while stop < len(parts) and (stop == start or chars + len(parts[stop]) <= _ENCODE_CHARS):
            chars += len(parts[stop])
            stop += 1
        for p, encoding in enumerate(encode(parts[start:stop], add_special_tokens=False), start=start):
            ids = np.array(encoding.ids, dtype=np.uint32)
            arrays.append(ids)
            lengths[owners[p]] += len(ids)
            if spans is not None:
                offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2) + starts[p]
                masks.append(span_mask(offsets, spans[owners[p]]))
            if p + 1 == len(owners) or owners[p + 1] != owners[p]:
                arrays.append(eos)
                lengths[owners[p]] += 1
                if spans is not None:
                    masks.append(np.zeros(1, dtype=np.uint8))  # the end of a document is no reply's
        start = stop
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)
    if spans is None:
        return tokens.astype(dtype), lengths, None
    return tokens.astype(dtype), lengths, np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)


def _parts(text: str) -> Iterator[str]:
    """A document in parts of `_PART_CHARS` to twice that many characters (one part if shorter), cut after a
    newline, else after a space, else anywhere: always at the same places, and never longer than the bound."""
    start = 0
    while len(text) - start > _PART_CHARS:
        limit = min(len(text), start + 2 * _PART_CHARS)
        cut = text.find("\n", start + _PART_CHARS, limit)
        if cut < 0:
            cut = text.find(" ", start + _PART_CHARS, limit)
        if cut < 0:
            cut = limit - 1  # no line or word ends within reach (minified code, say): cut mid-word
        if cut + 1 >= len(text):
            break
        yield text[start:cut + 1]
        start = cut + 1
    yield text[start:]
