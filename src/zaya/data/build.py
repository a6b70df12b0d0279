"""`zaya data build`: text files in, a tokenized dataset out.

    files = discover(inputs)              # every input kind (corpus.py), in a fixed order
    pieces = split_file(...)              # record-aligned byte ranges, row groups, record batches, or a stream
    tokenizer = given or train_bpe(...)   # trained on a bounded sample of the train documents
    tokenize pieces in worker processes   # results come back in piece order: the output is deterministic
    DatasetWriter -> manifest             # inside a staging directory renamed into place at the end

The pieces are shared out to the workers as units of work (`build_units.py`); what a worker does with
one is in `build_worker.py`.

With `format="chat"` the records are chats (JSON objects with `messages`), each rendered with a chat template
into one document (`chat.py`), and every token also gets a loss-mask flag: 1 inside the assistant turns, 0
elsewhere, stored beside the tokens (`shards.py`). A BPE trained here learns from the rendered chats cut at the
template's markers, which become its special tokens; a given tokenizer must have them.

Which split a document goes to depends only on its text (a hash compared with the validation fraction), so
the split is the same whatever the number of workers, the file order within a run, or the output directory.
The output does not depend on how the work is cut into pieces either: every document is tokenized on its own
(documents longer than 256 Ki characters are tokenized in parts, always cut at the same places). Nor
does it depend on how the documents were packaged: the same documents in the same order build the same
dataset, with the same fingerprint, from one `.jsonl` file or from a hundred compressed shards, CSV files or a
saved `datasets` directory. (How many files there were is recorded in build.json, not in the manifest.)

Memory is bounded by the number of workers W and the tokenizer sample, not by the size of the corpus:

- each worker (`build_worker.py`) holds at most `_BUFFER_BYTES` (2 MB) of documents' text, or one document
  if it is longer, and encodes them in calls of about `_ENCODE_CHARS` (256 Ki characters; a document is cut
  into parts of at most 512 Ki), for which the `tokenizers` encoder needs tens of bytes per character; the
  tokens go to the job's files in the staging directory (`spill.py`). About 50 MB per worker above the
  interpreter's baseline (measured with an 8192-entry BPE on Python source: 40-46 MB);
- the main process reads records one by one to train the tokenizer, and later copies one chunk of tokens at a
  time (a worker's 2 MB batch: 1-2 MB of tokens) from those files into the dataset; a compressed file is
  decompressed about 1 MB at a time;
- training the BPE costs the `tokenizers` trainer's table of the distinct words in its sample, which is at
  most `tokenizer_sample_bytes` of text (`--bpe-sample-mb`, 1 GiB by default) and grows less than linearly
  with it (measured on Python source: 54 MB for a 2 MB sample, 124 MB for 12 MB).

So the peak is about baseline + W x 50 MB + the BPE trainer's table (+ one document, if one is longer than
2 MB), whatever the size of the corpus; tests/data/test_corpora.py measures it. Arrow inputs are
memory-mapped: their pages count as resident while read, but they are the operating system's file cache.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

from zaya.data.build_units import group_units, piece_work, plan_pieces, run_order, target_bytes
from zaya.data.build_worker import MAX_REPORTED_PROBLEMS, Job, JobResult, encode_job, is_val
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE, ChatFormat, read_template
from zaya.data.corpus import InputFile, Piece, ReadOptions, Selection, discover, location, stream_piece
from zaya.data.dataset_writer import DatasetWriter, staged_directory
from zaya.data.shards import BUILD_FILE, DEFAULT_SHARD_TOKENS, SPLITS, fingerprint_of, token_dtype
from zaya.data.tokenizer import (
    BOS_TOKEN,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    added_tokens,
    check_markers,
    check_vocab_size,
    describe,
    open_tokenizer,
    tokenizer_bytes,
    train_bpe,
)
from zaya.errors import ZayaError

DEFAULT_VAL_FRACTION = 0.01
FORMATS = ("text", "chat")
_CHAT_KINDS = ("jsonl", "json", "parquet", "arrow")  # JSON records, or tables with a `messages` column
DEFAULT_TOKENIZER_SAMPLE_BYTES = 1 << 30
_SPILL_DIR = ".tokens"
_TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
_PR_SET_PDEATHSIG = 1  # prctl: the signal a process gets when its parent dies


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
    include: tuple[str, ...] = ()  # glob patterns choosing the files inside input directories
    exclude: tuple[str, ...] = ()
    split: str | None = None  # the split of a saved DatasetDict (`train` when None)
    eos_token: str = EOS_TOKEN
    strict: bool = False
    workers: int = 0  # 0: one per CPU core
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES
    overwrite: bool = False
    progress: bool = False
    format: str = "text"  # or "chat": records are chats, rendered with `chat_template` (see the module docstring)
    chat_template: Path | None = None  # a Jinja file; None: DEFAULT_CHAT_TEMPLATE


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
    files: int = 0  # input files read


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
    files = discover(options.inputs, Selection(options.include, options.exclude), options.split)
    given = open_tokenizer(options.tokenizer) if options.tokenizer is not None else None
    chat = _chat_format(options, files, given[0] if given else None)
    read = ReadOptions(options.text_field, options.doc_separator, chat)
    pieces = plan_pieces(files, read, workers)
    with staged_directory(options.out, options.overwrite) as staging:
        markers = chat.markers if chat is not None else ()
        tokenizer, tokenizer_json = given or _train_tokenizer(options, files, pieces, read, markers)
        info = describe(tokenizer, tokenizer_json, str(options.tokenizer or "the trained tokenizer"),
                        options.eos_token, markers)
        writer = DatasetWriter(staging, token_dtype(info.vocab_size), options.shard_tokens, loss_mask=chat is not None)
        spill = staging / _SPILL_DIR
        spill.mkdir()
        try:
            tally = _tokenize(options, files, pieces, read, tokenizer_json, info.eos_id, writer, workers, spill)
        except BaseException:
            writer.abort()
            raise
        shutil.rmtree(spill)  # inside this build's own staging directory: only what its workers wrote
        if tally.documents == 0:
            writer.abort()
            first = f"; the first: {tally.problems[0]}" if tally.problems else ""
            raise ZayaError(f"no documents in the inputs ({len(files)} files, {tally.text_bytes} bytes of text, "
                            f"{tally.bad_records} bad records{first})")
        template = None if chat is None else {"template": chat.template, "end_of_turn": chat.end_of_turn}
        manifest = writer.finish(tokenizer_json, info.to_dict(), tally.corpus(), template)
        report = BuildReport(
            path=Path(options.out),
            fingerprint=fingerprint_of(manifest),
            manifest=manifest,
            seconds=time.perf_counter() - started,
            text_bytes=tally.text_bytes,
            bad_records=tally.bad_records,
            invalid_utf8_documents=tally.invalid_utf8,
            problems=tally.problems,
            files=len(files),
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
    for flag, patterns in (("--include", options.include), ("--exclude", options.exclude)):
        if any(not pattern.strip("/") for pattern in patterns):
            raise ZayaError(f"{flag} needs a pattern such as '*.py', got an empty one")
    if options.format not in FORMATS:
        raise ZayaError(f"--format must be one of {', '.join(FORMATS)}, got {options.format!r}")
    if options.chat_template is not None and options.format != "chat":
        raise ZayaError("--chat-template is for chat data: add --format chat")


# ---- the tokenizer ------------------------------------------------------------------------------------


def _chat_format(options: BuildOptions, files: Sequence[InputFile], tokenizer: Tokenizer | None) -> ChatFormat | None:
    """The chat template of a chat build, checked against the inputs and a given tokenizer (None for text)."""
    if options.format != "chat":
        return None
    for file in files:
        if file.kind not in _CHAT_KINDS:
            raise ZayaError(f"{file.path}: --format chat reads JSON lines (.jsonl, also .gz or .zst), JSON arrays "
                            f"of chats and parquet or arrow tables with a 'messages' column, not {file.kind} files")
    if options.chat_template is None:
        template, source = DEFAULT_CHAT_TEMPLATE, "the default chat template"
    else:
        template, source = read_template(options.chat_template), str(options.chat_template)
    has_bos = tokenizer is None or tokenizer.token_to_id(BOS_TOKEN) is not None
    chat = ChatFormat.create(template, bos_token=BOS_TOKEN if has_bos else None, eos_token=options.eos_token,
                             tokens=added_tokens(tokenizer) if tokenizer is not None else (), source=source)
    if tokenizer is not None:
        check_markers(tokenizer, chat.markers, str(options.tokenizer))
    return chat


def _train_tokenizer(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece],
                     read: ReadOptions, markers: Sequence[str]) -> tuple[Tokenizer, bytes]:
    texts = _training_texts(options, files, pieces, read)
    if markers:  # the trainer would learn merges across them: it sees text, not special tokens
        cut = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        texts = (part for text in texts for part in cut.split(text) if part)
    if options.progress:
        print("training the tokenizer", file=sys.stderr)
    tokenizer = _interruptible(
        lambda feed: train_bpe(feed, options.vocab_size, progress=options.progress, extra_special_tokens=markers),
        texts)
    return tokenizer, tokenizer_bytes(tokenizer)


class _Stopped(Exception):
    """Raised into the BPE trainer's input when the build is interrupted: it ends the training."""


def _interruptible(train: Callable[[Iterator[str]], Tokenizer], texts: Iterator[str]) -> Tokenizer:
    """`train(texts)`, run in a thread while this one waits. The trainer reads its input from threads of its
    own and keeps the main thread in native code until it ends, and Python runs the handlers of Ctrl-C and
    SIGTERM only in the main thread: without this a build would ignore them for as long as training takes.
    When one arrives here, the input stops, which ends the training, and the interruption goes on its way."""
    stop = threading.Event()
    outcome: dict[str, object] = {}

    def feed() -> Iterator[str]:
        for text in texts:
            if stop.is_set():
                raise _Stopped
            yield text

    def run() -> None:
        try:
            outcome["tokenizer"] = train(feed())
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="zaya-bpe", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except BaseException:
        stop.set()
        thread.join()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["tokenizer"]


def _training_texts(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece],
                    read: ReadOptions) -> Iterator[str]:
    """The train documents the BPE learns from: all of them, or an even share of every file (by its size on
    disk) when the corpus is larger than `tokenizer_sample_bytes`. Read record by record, so only the trainer's
    word counts stay in memory. Bad records are fatal here already in strict mode."""
    total = sum(f.size for f in files)
    share = options.tokenizer_sample_bytes / total if total else 1.0
    # a whole corpus that fits is used whole, however much its files' text outweighs their compressed size
    budget = [share * f.size if share < 1.0 else math.inf for f in files]
    used = [0] * len(files)
    records_before = [0] * len(files)
    for piece in pieces:
        file = files[piece.file]
        if used[piece.file] > budget[piece.file]:
            continue
        stream = stream_piece(file, piece, read)
        try:
            for record in stream:
                if record.text is None:
                    if options.strict or record.fatal:
                        where = location(file, records_before[piece.file] + record.index, read)
                        raise ZayaError(f"{where}: {record.problem}")
                    continue
                data = record.text.encode("utf-8")
                if not is_val(data, options.val_fraction):
                    used[piece.file] += len(data)
                    yield record.text
                if used[piece.file] > budget[piece.file]:
                    break  # the rest of this file is not needed: stop reading it
        finally:
            stream.close()
        records_before[piece.file] += stream.count


# ---- tokenizing in worker processes -------------------------------------------------------------------


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

    def corpus(self) -> dict:
        # What the documents are, not how they were packaged: the number of input files stays out of the
        # manifest (and so out of the fingerprint); build.json records it.
        return {"text_bytes": self.text_bytes, "documents": self.documents, "bad_records": self.bad_records,
                "invalid_utf8_documents": self.invalid_utf8}


def _tokenize(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece], read: ReadOptions,
              tokenizer_json: bytes, eos_id: int, writer: DatasetWriter, workers: int, spill: Path) -> _Tally:
    total = sum(p.size for p in pieces)
    work = [piece_work(files, p) for p in pieces]
    units = group_units(pieces, work, target_bytes(sum(work), workers))
    jobs = [
        Job(tokenizer_json, eos_id, writer.dtype, options.val_fraction, options.strict, read,
            tuple(files[p.file] for p in unit), unit, str(spill / f"{i:07d}"))
        for i, unit in enumerate(units)
    ]
    run = run_order([sum(piece_work(files, p) for p in unit) for unit in units], workers)
    tally = _Tally()
    records_before = [0] * len(files)
    finished: dict[int, JobResult] = {}
    written = 0
    with _mapper(min(workers, len(jobs))) as mapper, tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not options.progress
    ) as bar:
        for index, result in zip(run, mapper(encode_job, [jobs[i] for i in run]), strict=True):
            finished[index] = result  # only sizes and counts: the tokens wait on disk
            bar.update(sum(p.size for p in units[index]))
            while written in finished:  # results are written in input order, whatever order they ran in
                result = finished.pop(written)
                try:
                    _collect(jobs[written], result, tally, records_before, read, writer)
                finally:
                    result.tokens.remove()
                written += 1
    return tally


def _collect(job: Job, result: JobResult, tally: _Tally, records_before: list[int], read: ReadOptions,
             writer: DatasetWriter) -> None:
    """Write one unit's tokens and account for its records; `records_before` numbers records per file."""
    if result.fatal is not None:  # --strict's first bad record, or a template past its budget
        i, index, problem = result.fatal
        raise ZayaError(f"{location(job.files[i], records_before[job.pieces[i].file] + index, read)}: {problem}")
    for i, index, problem in result.problems:
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        tally.note(f"{where}: {problem}")
    tally.bad_records += result.bad_records
    for i, index in result.invalid_utf8:
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        tally.note(f"{where}: invalid UTF-8, replaced by U+FFFD")
    tally.invalid_utf8 += result.invalid_utf8_documents
    for piece, count in zip(job.pieces, result.counts, strict=True):
        records_before[piece.file] += count
    for split in SPLITS:
        for tokens, doc_lengths, mask in result.tokens.read(split):
            writer.write(split, tokens, doc_lengths, mask)
            tally.documents += len(doc_lengths)
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
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_worker_signals)
    finally:
        if previous is None:
            del os.environ[_TOKENIZERS_PARALLELISM]
        else:
            os.environ[_TOKENIZERS_PARALLELISM] = previous
    with pool:  # leaving it in any way (an error, Ctrl-C, SIGTERM) terminates the workers and waits for them
        yield functools.partial(pool.imap, chunksize=1)


def _worker_signals() -> None:
    """A worker leaves interruptions to the main process: Ctrl-C (sent to the whole process group) is ignored,
    SIGTERM (the pool's own way to end a worker) ends it at once, without a traceback, and it ends with the
    main process if that is killed outright (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _write_build_info(path: Path, options: BuildOptions, workers: int, report: BuildReport) -> None:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()
                if k not in ("out", "overwrite", "progress")}
    info = {
        "options": {**settings, "workers": workers},
        "files": report.files,
        "seconds": round(report.seconds, 3),
        "text_bytes": report.text_bytes,
        "bad_records": report.bad_records,
        "invalid_utf8_documents": report.invalid_utf8_documents,
        "problems": report.problems,
    }
    path.write_text(json.dumps(info, indent=2) + "\n")
