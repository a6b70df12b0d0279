"""`zaya data build`: text files in, a tokenized dataset out.

    files = discover(inputs)              # .txt / .jsonl / .parquet / stdlib, in a fixed order
    pieces = split_file(...)              # record-aligned byte ranges or row groups, balanced over workers
    tokenizer = given or train_bpe(...)   # trained on the train documents only
    tokenize pieces in worker processes   # results come back in piece order: the output is deterministic
    DatasetWriter -> manifest             # inside a staging directory renamed into place at the end

Which split a document goes to depends only on its text (a hash compared with the validation fraction), so
the split is the same whatever the number of workers, the file order within a run, or the output directory.
The output does not depend on how the work is cut into pieces either: every document is tokenized on its own
(documents longer than a few MB are tokenized in newline-aligned parts, always cut at the same places).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from zaya.data.corpus import InputFile, Piece, ReadOptions, discover, location, read_piece, split_file
from zaya.data.shards import (
    BUILD_FILE,
    DEFAULT_SHARD_TOKENS,
    SPLITS,
    DatasetWriter,
    fingerprint_of,
    staged_directory,
    token_dtype,
)
from zaya.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    check_vocab_size,
    describe,
    open_tokenizer,
    tokenizer_bytes,
    train_bpe,
)
from zaya.errors import ZayaError

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_TOKENIZER_SAMPLE_BYTES = 1 << 30
MAX_REPORTED_PROBLEMS = 100
# Very long documents are tokenized in parts so one encode call never holds gigabytes of offsets.
_PART_CHARS = 1 << 22
_MIN_PIECE_BYTES = 1 << 18
_MAX_PIECE_BYTES = 1 << 23
_TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclass(frozen=True)
class BuildOptions:
    """Everything `zaya data build` can be told."""

    inputs: tuple[str, ...]
    out: Path
    tokenizer: Path | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    val_fraction: float = DEFAULT_VAL_FRACTION
    text_field: str = "text"
    doc_separator: str | None = None
    eos_token: str = EOS_TOKEN
    strict: bool = False
    workers: int = 0  # 0: one per CPU core
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES
    overwrite: bool = False
    progress: bool = False


@dataclass
class BuildReport:
    """What a build produced and what it had to skip."""

    path: Path
    fingerprint: str
    manifest: dict
    seconds: float
    text_bytes: int
    bad_records: int = 0
    invalid_utf8_documents: int = 0
    problems: list[str] = field(default_factory=list)  # the first MAX_REPORTED_PROBLEMS, with locations


def default_workers() -> int:
    """One worker per CPU core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_dataset(options: BuildOptions) -> BuildReport:
    """Tokenize `options.inputs` into a dataset at `options.out`; see the module docstring."""
    started = time.perf_counter()
    _check_options(options)
    workers = options.workers or default_workers()
    read = ReadOptions(options.text_field, options.doc_separator)
    files = discover(options.inputs)
    pieces = _plan(files, read, workers)
    with staged_directory(options.out, options.overwrite) as staging:
        tokenizer, tokenizer_json = _tokenizer(options, files, pieces, read)
        info = describe(tokenizer, tokenizer_json, str(options.tokenizer or "the trained tokenizer"),
                        options.eos_token)
        writer = DatasetWriter(staging, token_dtype(info.vocab_size), options.shard_tokens)
        try:
            tally = _tokenize(options, files, pieces, read, tokenizer_json, info.eos_id, writer, workers)
        except BaseException:
            writer.abort()
            raise
        if tally.documents == 0:
            writer.abort()
            raise ZayaError(f"no documents in the inputs ({len(files)} files, {tally.text_bytes} bytes of text, "
                            f"{tally.bad_records} bad records)")
        manifest = writer.finish(tokenizer_json, info.to_dict(), tally.corpus(len(files)))
        report = BuildReport(
            path=Path(options.out),
            fingerprint=fingerprint_of(manifest),
            manifest=manifest,
            seconds=time.perf_counter() - started,
            text_bytes=tally.text_bytes,
            bad_records=tally.bad_records,
            invalid_utf8_documents=tally.invalid_utf8,
            problems=tally.problems,
        )
        _write_build_info(staging / BUILD_FILE, options, workers, report)
    return report


def _check_options(options: BuildOptions) -> None:
    if options.tokenizer is None:
        check_vocab_size(options.vocab_size)
    if not 0.0 <= options.val_fraction < 1.0:
        raise ZayaError(f"--val-fraction must be in [0, 1), got {options.val_fraction}")
    if options.workers < 0:
        raise ZayaError(f"--workers must be positive, got {options.workers}")
    if options.doc_separator == "":
        raise ZayaError("--doc-separator must not be empty")


def _target_bytes(total: int, workers: int) -> int:
    """About total / (16 * workers) bytes of work per job, so every worker gets several and none waits long."""
    return min(_MAX_PIECE_BYTES, max(_MIN_PIECE_BYTES, total // (16 * workers)))


def _plan(files: Sequence[InputFile], read: ReadOptions, workers: int) -> list[Piece]:
    target = _target_bytes(sum(f.size for f in files), workers)
    return [piece for i, f in enumerate(files) for piece in split_file(f, i, read, target)]


def _units(pieces: Sequence[Piece], target: int) -> list[tuple[Piece, ...]]:
    """Consecutive pieces grouped into units of work of about `target` bytes: small files share a unit, and a
    piece of `target` bytes or more is a unit of its own."""
    units: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        if piece.size >= target:
            if current:
                units.append(tuple(current))
                current, size = [], 0
            units.append((piece,))
            continue
        current.append(piece)
        size += piece.size
        if size >= target:
            units.append(tuple(current))
            current, size = [], 0
    if current:
        units.append(tuple(current))
    return units


# ---- the tokenizer ------------------------------------------------------------------------------------


def _tokenizer(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece],
               read: ReadOptions) -> tuple[Tokenizer, bytes]:
    if options.tokenizer is not None:
        return open_tokenizer(options.tokenizer)
    texts = _training_texts(options, files, pieces, read)
    if options.progress:
        print("training the tokenizer", file=sys.stderr)
    tokenizer = train_bpe(texts, options.vocab_size, progress=options.progress)
    return tokenizer, tokenizer_bytes(tokenizer)


def _training_texts(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece],
                    read: ReadOptions) -> Iterator[str]:
    """The train documents the BPE learns from: all of them, or an even share of every file when the corpus
    is larger than `tokenizer_sample_bytes`. Bad records are fatal here already in strict mode."""
    total = sum(f.size for f in files)
    share = min(1.0, options.tokenizer_sample_bytes / total) if total else 1.0
    used = [0] * len(files)
    records_before = [0] * len(files)
    for piece in pieces:
        file = files[piece.file]
        if used[piece.file] > share * file.size:
            continue
        contents = read_piece(file, piece, read)
        for record in contents.records:
            if record.text is None:
                if options.strict:
                    where = location(file, records_before[piece.file] + record.index, read)
                    raise ZayaError(f"{where}: {record.problem}")
                continue
            data = record.text.encode("utf-8")
            if not _is_val(data, options.val_fraction):
                used[piece.file] += len(data)
                yield record.text
            if used[piece.file] > share * file.size:
                break
        records_before[piece.file] += contents.count


def _is_val(data: bytes, fraction: float) -> bool:
    """Whether a document is held out: a hash of its text against the fraction, stable across builds."""
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return digest < fraction * 2.0**64


# ---- tokenizing in worker processes -------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One unit of work for a worker process: a few pieces, and all it needs to tokenize them."""

    tokenizer_json: bytes
    eos_id: int
    dtype: str
    val_fraction: float
    strict: bool
    read: ReadOptions
    files: tuple[InputFile, ...]  # the input file of each piece
    pieces: tuple[Piece, ...]


@dataclass
class _Result:
    tokens: dict[str, np.ndarray]
    doc_lengths: dict[str, np.ndarray]
    counts: list[int]  # record positions spanned by each piece
    problems: list[tuple[int, int, str]]  # (piece, record within the piece, what is wrong)
    invalid_utf8: list[tuple[int, int]]  # (piece, record within the piece)
    text_bytes: int
    fatal: bool = False


@dataclass
class _Tally:
    """Running totals over the results, in order."""

    text_bytes: int = 0
    documents: int = 0
    bad_records: int = 0
    invalid_utf8: int = 0
    problems: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(message)

    def corpus(self, num_files: int) -> dict:
        return {"files": num_files, "text_bytes": self.text_bytes, "documents": self.documents,
                "bad_records": self.bad_records, "invalid_utf8_documents": self.invalid_utf8}


def _tokenize(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece], read: ReadOptions,
              tokenizer_json: bytes, eos_id: int, writer: DatasetWriter, workers: int) -> _Tally:
    total = sum(p.size for p in pieces)
    units = _units(pieces, _target_bytes(total, workers))
    jobs = [
        _Job(tokenizer_json, eos_id, writer.dtype, options.val_fraction, options.strict, read,
             tuple(files[p.file] for p in unit), unit)
        for unit in units
    ]
    run = _run_order([sum(p.size for p in unit) for unit in units], workers)
    tally = _Tally()
    records_before = [0] * len(files)
    finished: dict[int, _Result] = {}
    written = 0
    with _mapper(min(workers, len(jobs))) as mapper, tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not options.progress
    ) as bar:
        for index, result in zip(run, mapper(_encode_job, [jobs[i] for i in run]), strict=True):
            finished[index] = result
            bar.update(sum(p.size for p in units[index]))
            while written in finished:  # results are written in input order, whatever order they ran in
                _collect(jobs[written], finished.pop(written), tally, records_before, read, writer)
                written += 1
    return tally


def _run_order(sizes: Sequence[int], workers: int) -> list[int]:
    """The order to run units in: the largest first within each run of 4 * workers units, so that no worker
    is left alone with a big one at the end. Results wait for their turn to be written, at most one run's."""
    window = 4 * workers
    order: list[int] = []
    for start in range(0, len(sizes), window):
        order.extend(sorted(range(start, min(start + window, len(sizes))), key=lambda i: (-sizes[i], i)))
    return order


def _collect(job: _Job, result: _Result, tally: _Tally, records_before: list[int], read: ReadOptions,
             writer: DatasetWriter) -> None:
    """Write one unit's tokens and account for its records; `records_before` numbers records per file."""
    for i, index, problem in result.problems:
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        if result.fatal:
            raise ZayaError(f"{where}: {problem}")
        tally.bad_records += 1
        tally.note(f"{where}: {problem}")
    for i, index in result.invalid_utf8:
        tally.invalid_utf8 += 1
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        tally.note(f"{where}: invalid UTF-8, replaced by U+FFFD")
    for piece, count in zip(job.pieces, result.counts, strict=True):
        records_before[piece.file] += count
    for split in SPLITS:
        writer.write(split, result.tokens[split], result.doc_lengths[split])
        tally.documents += len(result.doc_lengths[split])
    tally.text_bytes += result.text_bytes


@contextlib.contextmanager
def _mapper(workers: int) -> Iterator[Callable[[Callable, Iterable], Iterator]]:
    """An ordered `map` over worker processes (or in this process for one worker)."""
    if workers <= 1:
        yield map
        return
    # Forking shares the loaded modules (a spawned worker would spend seconds importing torch through the
    # zaya package). Each worker then encodes on one thread: the processes are the parallelism, and the
    # variable also keeps `tokenizers` from warning that a fork disabled its thread pool. It is set only
    # while the workers are created, which is when they copy the environment.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    previous = os.environ.get(_TOKENIZERS_PARALLELISM)
    os.environ[_TOKENIZERS_PARALLELISM] = "false"
    try:
        pool = multiprocessing.get_context(method).Pool(workers)
    finally:
        if previous is None:
            del os.environ[_TOKENIZERS_PARALLELISM]
        else:
            os.environ[_TOKENIZERS_PARALLELISM] = previous
    with pool:
        yield functools.partial(pool.imap, chunksize=1)


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(tokenizer_json: bytes) -> Tokenizer:
    # every job carries the tokenizer; a worker parses it once and reuses it for the jobs that follow
    return Tokenizer.from_str(tokenizer_json.decode("utf-8"))


def _encode_job(job: _Job) -> _Result:
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    result = _Result({}, {}, [], [], [], 0)
    for i, (file, piece) in enumerate(zip(job.files, job.pieces, strict=True)):
        contents = read_piece(file, piece, job.read)
        result.counts.append(contents.count)
        for record in contents.records:
            if record.text is None:
                result.problems.append((i, record.index, record.problem))
                if job.strict:
                    result.fatal = True
                    return result
                continue
            if record.invalid_utf8:
                result.invalid_utf8.append((i, record.index))
            data = record.text.encode("utf-8")
            result.text_bytes += len(data)
            texts["val" if _is_val(data, job.val_fraction) else "train"].append(record.text)
    tokenizer = _worker_tokenizer(job.tokenizer_json)
    for split, documents in texts.items():
        result.tokens[split], result.doc_lengths[split] = _encode(tokenizer, documents, job.eos_id, job.dtype)
    return result


def _encode(tokenizer: Tokenizer, documents: list[str], eos_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Documents to one token array (each followed by `eos_id`) and the documents' lengths."""
    parts, owners = [], []
    for d, text in enumerate(documents):
        for part in _parts(text):
            parts.append(part)
            owners.append(d)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster, same ids
    encodings = encode(parts, add_special_tokens=False)
    ids: list[int] = []
    lengths = np.zeros(len(documents), dtype=np.int64)
    for p, (owner, encoding) in enumerate(zip(owners, encodings, strict=True)):
        ids.extend(encoding.ids)
        lengths[owner] += len(encoding.ids)
        if p + 1 == len(owners) or owners[p + 1] != owner:
            ids.append(eos_id)
            lengths[owner] += 1
    return np.array(ids, dtype=np.uint32).astype(dtype), lengths


def _parts(text: str) -> Iterator[str]:
    """A document in newline-aligned parts of about `_PART_CHARS` characters (one part if shorter)."""
    start = 0
    while len(text) - start > _PART_CHARS:
        cut = text.find("\n", start + _PART_CHARS)
        if cut < 0:
            break
        yield text[start:cut + 1]
        start = cut + 1
    yield text[start:]


def _write_build_info(path: Path, options: BuildOptions, workers: int, report: BuildReport) -> None:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()
                if k not in ("out", "overwrite", "progress")}
    info = {
        "options": {**settings, "workers": workers},
        "seconds": round(report.seconds, 3),
        "text_bytes": report.text_bytes,
        "bad_records": report.bad_records,
        "invalid_utf8_documents": report.invalid_utf8_documents,
        "problems": report.problems,
    }
    path.write_text(json.dumps(info, indent=2) + "\n")
