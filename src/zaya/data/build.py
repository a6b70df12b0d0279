"""`zaya data build`: text files in, a tokenized dataset out.

    files = discover(inputs)              # every input kind (corpus.py), in a fixed order
    pieces = split_file(...)              # record-aligned byte ranges, row groups, record batches, or a stream
    tokenizer = given or train_bpe(...)   # trained on a bounded sample of the train documents
    tokenize pieces in worker processes   # results come back in piece order: the output is deterministic
    DatasetWriter -> manifest             # inside a staging directory renamed into place at the end

The pieces are shared out to the workers as units of work (`build_units.py`); what a worker does with
one is in `build_worker.py`, and what the main process keeps of the results in `build_tally.py`. What the build
did not read (files of the input directories, bad records) and a split that came out empty are said in one
line each, with the flag that would change it (`skipped.py`).

With `format="chat"` the records are chats (JSON objects with `messages`), each rendered with a chat template
into one document (`chat.py`), and every token also gets a loss-mask flag: 1 inside the assistant turns, 0
elsewhere, stored beside the tokens (`shards.py`). A BPE trained here learns from the rendered chats cut at the
template's markers, which become its special tokens; a given tokenizer must have them. A text build reserves
the markers too when asked (`reserve_chat_markers`: its tokenizer then serves the chat build after it), and
either kind any further `special_tokens`; the texts are cut at them likewise.

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

from zaya.data.build_tally import Tally, collect
from zaya.data.build_units import (
    group_units,
    part_identity,
    part_pieces,
    piece_work,
    plan_pieces,
    run_order,
    target_bytes,
)
from zaya.data.build_worker import Job, JobResult, encode_job, is_val
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE, ChatFormat, read_template
from zaya.data.corpus import InputFile, Piece, ReadOptions, Selection, discover, location, stream_piece
from zaya.data.dataset_writer import DatasetWriter, staged_directory
from zaya.data.shards import BUILD_FILE, DEFAULT_SHARD_TOKENS, fingerprint_of, token_dtype
from zaya.data.skipped import SkippedFiles, split_warnings
from zaya.data.tokenizer import (
    BOS_TOKEN,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    added_tokens,
    check_markers,
    check_special_tokens,
    check_vocab_size,
    describe,
    is_single_token,
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
    # a text build's tokenizer keeps the chat template's markers whole (a chat build's always does), so that the
    # chats fine-tuned on later share it; `special_tokens` are kept whole in either
    reserve_chat_markers: bool = False
    special_tokens: tuple[str, ...] = ()
    # (I, N): build only the I-th (0-based) of N parts of the inputs (`build_units.part_pieces`), a dataset of its
    # own that `zaya data merge` joins with the others; it needs a given tokenizer, the same for every part
    part: tuple[int, int] | None = None


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
    problems: list[str] = field(default_factory=list)  # the first few (`build_worker.MAX_REPORTED_PROBLEMS`)
    files: int = 0  # input files read
    bad_record_reasons: dict[str, int] = field(default_factory=dict)  # bounded (`skipped.count_reason`)
    skipped_files: dict | None = None  # what the input directories held and the build did not read
    warnings: list[str] = field(default_factory=list)  # one line each: skipped files, bad records, the splits


def default_workers() -> int:
    """One worker per CPU core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_dataset(options: BuildOptions, warn: Callable[[str], None] | None = None) -> BuildReport:
    """Tokenize `options.inputs` into a dataset at `options.out`; see the module docstring. `warn` is given
    each warning line as soon as it is known: the files skipped once the inputs are found, the bad records
    (each, then a summary) and an empty or small split at the end. The report keeps the lines (`warnings`, and
    the bad records themselves in `problems`), and so does build.json."""
    started = time.perf_counter()
    _check_options(options)
    workers = options.workers or default_workers()
    skipped = SkippedFiles()
    files = discover(options.inputs, Selection(options.include, options.exclude), options.split, skipped)
    warnings = [skipped.text()] if skipped.worth_saying() else []
    if warn is not None:
        for line in warnings:
            warn(line)
    said = len(warnings)
    given = open_tokenizer(options.tokenizer) if options.tokenizer is not None else None
    chat = _chat_format(options, files, given[0] if given else None)
    read = ReadOptions(options.text_field, options.doc_separator, chat)
    pieces = plan_pieces(files, read, workers) if options.part is None else part_pieces(files, read, *options.part)
    with staged_directory(options.out, options.overwrite) as staging:
        markers = _reserved_tokens(options, chat, given[0] if given else None)
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
        if tally.documents == 0 and options.part is None:  # a part may be empty: its share of a small corpus
            writer.abort()
            why = f": {tally.reasons_text(options.text_field, chat is not None)}" if tally.bad_records else ""
            raise ZayaError(f"no documents in the inputs ({len(files)} files, {tally.text_bytes} bytes of text, "
                            f"{tally.bad_records} bad records{why})")
        template = None if chat is None else {"template": chat.template, "end_of_turn": chat.end_of_turn}
        corpus = tally.corpus()
        if options.part is not None:
            corpus["part"] = part_identity(options, files, info.sha256)
        manifest = writer.finish(tokenizer_json, info.to_dict(), corpus, template)
        warnings += tally.summary(options.text_field, chat is not None) + split_warnings(manifest, options.val_fraction)
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
            bad_record_reasons=tally.reasons,
            skipped_files=skipped.to_dict() if skipped.read or skipped.groups else None,
            warnings=warnings,
        )
        _write_build_info(staging / BUILD_FILE, options, workers, report)
    if warn is not None:
        for line in tally.problems + warnings[said:]:
            warn(line)
    return report


def build_tokenizer(options: BuildOptions) -> tuple[Tokenizer, bytes]:
    """The BPE a build of `options` would train (`options.out` unused), trained once and on its own, and its
    tokenizer.json as a build stores it: a build given this file (`--tokenizer`) writes the dataset a build that
    trains its own does, byte for byte, so that builds of parts of a corpus on many machines share one tokenizer.
    The sample is each file's first train documents, up to its share of `tokenizer_sample_bytes`: the same
    whatever the workers or the pieces."""
    if options.tokenizer is not None:
        raise ZayaError("a tokenizer is trained here, not given: leave out --tokenizer")
    _check_options(options)
    files = discover(options.inputs, Selection(options.include, options.exclude), options.split, SkippedFiles())
    chat = _chat_format(options, files, None)
    read = ReadOptions(options.text_field, options.doc_separator, chat)
    markers = _reserved_tokens(options, chat, None)
    tokenizer, data = _train_tokenizer(options, files, plan_pieces(files, read, 1), read, markers)
    describe(tokenizer, data, "the trained tokenizer", options.eos_token, markers)  # its eos and markers are there
    return tokenizer, data


def _check_options(options: BuildOptions) -> None:
    if options.part is not None:
        index, count = options.part
        if not 0 <= index < count:
            raise ZayaError(f"--part {index}/{count}: a part is I/N with 0 <= I < N (0-based)")
        if options.tokenizer is None:
            raise ZayaError("--part needs --tokenizer: the parts of one build must share one tokenizer (train it "
                            "once with `zaya data tokenizer`)")
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
    check_special_tokens(options.special_tokens)
    if options.chat_template is not None and options.format != "chat" and not options.reserve_chat_markers:
        raise ZayaError("--chat-template is for chat data: add --format chat (or --reserve-chat-markers, to reserve "
                        "its markers in a text build)")


# ---- the tokenizer ------------------------------------------------------------------------------------


def _chat_format(options: BuildOptions, files: Sequence[InputFile], tokenizer: Tokenizer | None) -> ChatFormat | None:
    """The chat template of a chat build, checked against the inputs and a given tokenizer (None for text)."""
    if options.format != "chat":
        return None
    for file in files:
        if file.kind not in _CHAT_KINDS:
            raise ZayaError(f"{file.path}: --format chat reads JSON lines (.jsonl, also .gz or .zst), JSON arrays "
                            f"of chats and parquet or arrow tables with a 'messages' column, not {file.kind} files")
    chat = _template(options, tokenizer)
    if tokenizer is not None:
        check_markers(tokenizer, chat.markers, str(options.tokenizer))
    return chat


def _template(options: BuildOptions, tokenizer: Tokenizer | None) -> ChatFormat:
    """The chat template (`--chat-template`, or the default), with its markers found."""
    if options.chat_template is None:
        template, source = DEFAULT_CHAT_TEMPLATE, "the default chat template"
    else:
        template, source = read_template(options.chat_template), str(options.chat_template)
    has_bos = tokenizer is None or tokenizer.token_to_id(BOS_TOKEN) is not None
    return ChatFormat.create(template, bos_token=BOS_TOKEN if has_bos else None, eos_token=options.eos_token,
                             tokens=added_tokens(tokenizer) if tokenizer is not None else (), source=source)


def _reserved_tokens(options: BuildOptions, chat: ChatFormat | None, given: Tokenizer | None) -> tuple[str, ...]:
    """The tokens the dataset's tokenizer keeps whole, besides <pad>, <eos> and <bos>: the chat template's markers
    (a chat build's, or a text build's with `reserve_chat_markers`), then `special_tokens`, without repeats. A given
    tokenizer must have each as one token already; a BPE to train must have room for them."""
    if chat is None and options.reserve_chat_markers:
        chat = _template(options, given)
    markers = chat.markers if chat is not None else ()
    reserved = tuple(dict.fromkeys(t for t in (*markers, *options.special_tokens) if t not in SPECIAL_TOKENS))
    if given is not None:
        for token in reserved:
            if not is_single_token(given, token):
                asked = "--special-token" if token in options.special_tokens else "--reserve-chat-markers"
                raise ZayaError(f"{options.tokenizer}: {asked} asks for {token!r}, which is not one token of this "
                                "tokenizer; give a tokenizer that has it as a special token, or leave out --tokenizer "
                                "to train one that reserves it")
    elif options.vocab_size < MIN_VOCAB_SIZE + len(reserved):
        raise ZayaError(f"--vocab-size {options.vocab_size} leaves no room for the {len(reserved)} reserved tokens: "
                        f"with the 256 byte symbols and {', '.join(SPECIAL_TOKENS)} they need at least "
                        f"{MIN_VOCAB_SIZE + len(reserved)}")
    return reserved


def _train_tokenizer(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece],
                     read: ReadOptions, reserved: Sequence[str]) -> tuple[Tokenizer, bytes]:
    texts = _training_texts(options, files, pieces, read)
    if reserved:  # the trainer would learn merges across them: it sees text, not special tokens
        cut = re.compile("|".join(re.escape(m) for m in sorted(reserved, key=len, reverse=True)))
        texts = (part for text in texts for part in cut.split(text) if part)
    if options.progress:
        print("training the tokenizer", file=sys.stderr)
    tokenizer = _interruptible(
        lambda feed: train_bpe(feed, options.vocab_size, progress=options.progress, extra_special_tokens=reserved),
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


def _tokenize(options: BuildOptions, files: Sequence[InputFile], pieces: Sequence[Piece], read: ReadOptions,
              tokenizer_json: bytes, eos_id: int, writer: DatasetWriter, workers: int, spill: Path) -> Tally:
    total = sum(p.size for p in pieces)
    work = [piece_work(files, p) for p in pieces]
    units = group_units(pieces, work, target_bytes(sum(work), workers))
    jobs = [
        Job(tokenizer_json, eos_id, writer.dtype, options.val_fraction, options.strict, read,
            tuple(files[p.file] for p in unit), unit, str(spill / f"{i:07d}"))
        for i, unit in enumerate(units)
    ]
    run = run_order([sum(piece_work(files, p) for p in unit) for unit in units], workers)
    tally = Tally()
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
                    collect(jobs[written], result, tally, records_before, read, writer)
                finally:
                    result.tokens.remove()
                written += 1
    return tally


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
        "bad_record_reasons": report.bad_record_reasons,
        "invalid_utf8_documents": report.invalid_utf8_documents,
        "problems": report.problems,
        "warnings": report.warnings,
    }
    if report.skipped_files is not None:
        info["skipped_files"] = report.skipped_files
    path.write_text(json.dumps(info, indent=2) + "\n")
