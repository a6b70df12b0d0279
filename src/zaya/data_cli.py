"""`zaya data`: build a tokenized dataset from text, and inspect or verify one.

    zaya data build --input corpus/ notes.jsonl --out data/mine          # trains an 8192-entry BPE
    zaya data build --input stdlib --out data/stdlib                    # the Python standard library
    zaya data build --input corpus/ --out data/mine --tokenizer tokenizer.json
    zaya data build --input repo/ --include '*.py' --include '*.md' --exclude 'tests/**' --out data/code
    zaya data build --input shards/ --out data/web                     # *.jsonl.zst, *.jsonl.gz, ...
    zaya data build --input saved_dataset/ --split train --out data/hf  # a `save_to_disk` directory
    zaya data build --format chat --input chats.jsonl --out data/sft     # {"messages": [...]} per line
    zaya data build --input corpus/ --out data/base --reserve-chat-markers   # chats later on the same tokenizer
    zaya data build --format chat --input chats.jsonl --out data/sft --tokenizer runs/base   # the run's tokenizer
    zaya data tokenizer --input corpus/ --out tokenizer.json           # the BPE alone, for builds that share it
    zaya data inspect data/mine --verify

Every input kind and its options: docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import click

from zaya.data.build import (
    DEFAULT_TOKENIZER_SAMPLE_BYTES,
    DEFAULT_VAL_FRACTION,
    FORMATS,
    BuildOptions,
    build_dataset,
)
from zaya.data.dataset_reader import Dataset, open_dataset
from zaya.data.shards import BUILD_FILE, DEFAULT_SHARD_TOKENS
from zaya.data.tokenizer import DEFAULT_VOCAB_SIZE, EOS_TOKEN, SPECIAL_TOKENS
from zaya.errors import ZayaError
from zaya.reading import read_json_object
from zaya.schema import Fields


@click.group()
def data() -> None:
    """Build and inspect tokenized datasets."""


def _corpus_options(command):
    """The options that say what a build reads and how its tokenizer is trained: `data build`'s and
    `data tokenizer`'s alike, so that the tokenizer trained alone is the one the build would train."""
    options = [
        click.option("--input", "-i", "inputs", multiple=True, metavar="PATH",
                     help="A .txt, .jsonl, .json, .csv, .tsv, .parquet or .arrow file (the text formats also .gz or "
                          ".zst), a directory of them, a saved Hugging Face dataset, or 'stdlib' (the Python "
                          "standard library's source). Repeatable; further paths may follow as arguments."),
        click.argument("more_inputs", nargs=-1, metavar="[PATH]..."),
        click.option("--format", "data_format", type=click.Choice(FORMATS), default="text", show_default=True,
                     help="'chat': each JSON record is a chat, {\"messages\": [{\"role\": ..., \"content\": ...}]}, "
                          "rendered with a chat template; the model learns the assistant turns only."),
        click.option("--chat-template", type=click.Path(path_type=Path), default=None, metavar="FILE",
                     help="A Jinja chat template in transformers' convention [default: a ChatML-like one, "
                          "<|im_start|>role ... <|im_end|>]; in a text build, the one --reserve-chat-markers reads."),
        click.option("--reserve-chat-markers", is_flag=True,
                     help="Text builds: the BPE keeps the chat template's markers as single special tokens, so "
                          "that a chat build for fine-tuning can reuse this dataset's tokenizer (chat builds always "
                          "do)."),
        click.option("--special-token", "special_tokens", multiple=True, metavar="TOKEN",
                     help="Keep TOKEN as one special token of the BPE (the text is cut at it). Repeatable."),
        click.option("--vocab-size", type=int, default=None,
                     help=f"Size of the BPE to train [default: {DEFAULT_VOCAB_SIZE}]."),
        click.option("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, show_default=True,
                     help="Share of documents held out for validation, chosen by a hash of their text."),
        click.option("--include", multiple=True, metavar="PATTERN",
                     help="Read only the files inside input directories that match this glob ('*.py', "
                          "'src/**/*.md'; matched against the relative path and the name), as text unless of a "
                          "known kind. Repeatable."),
        click.option("--exclude", multiple=True, metavar="PATTERN",
                     help="Skip the files and directories inside input directories that match this glob. "
                          "Repeatable."),
        click.option("--split", "dataset_split", default=None, metavar="NAME",
                     help="The split of a saved Hugging Face DatasetDict to read [default: train]."),
        click.option("--text-field", default="text", show_default=True,
                     help="The text field of JSON records, the text column of tables and CSV files."),
        click.option("--doc-separator", default=None,
                     help="Split .txt files into documents at this string (default: one document per file)."),
        click.option("--eos-token", default=EOS_TOKEN, show_default=True,
                     help="The end-of-document token appended to each document."),
        click.option("--strict", is_flag=True, help="Stop at the first bad record instead of skipping it."),
        click.option("--bpe-sample-mb", type=click.IntRange(min=1), default=DEFAULT_TOKENIZER_SAMPLE_BYTES >> 20,
                     show_default=True, help="Train the BPE on at most this much text, an even share of every file."),
        click.option("--progress/--no-progress", default=None,
                     help="Progress bars on stderr [default: when stderr is a terminal]."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _options(inputs, more_inputs, out, data_format, chat_template, reserve_chat_markers, special_tokens, vocab_size,
             val_fraction, include, exclude, dataset_split, text_field, doc_separator, eos_token, strict, bpe_sample_mb,
             progress, **rest) -> BuildOptions:
    return BuildOptions(
        inputs=(*inputs, *more_inputs), out=out, vocab_size=DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size,
        val_fraction=val_fraction, text_field=text_field, doc_separator=doc_separator, include=include,
        exclude=exclude, split=dataset_split, eos_token=eos_token, strict=strict,
        tokenizer_sample_bytes=bpe_sample_mb << 20, progress=sys.stderr.isatty() if progress is None else progress,
        format=data_format, chat_template=chat_template, reserve_chat_markers=reserve_chat_markers,
        special_tokens=special_tokens, **rest)


@data.command()
@_corpus_options
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="The dataset directory to write.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="Use this tokenizer instead of training a byte-level BPE: a tokenizer.json (`zaya data "
                   "tokenizer` trains one alone), or the one of a dataset, a checkpoint, a Hugging Face export or a "
                   "run (its newest valid checkpoint's).")
@click.option("--workers", type=int, default=0, help="Tokenizer processes [default: one per CPU core].")
@click.option("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, show_default=True,
              help="Tokens per super-shard file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
@click.option("--part", default=None, metavar="I/N",
              help="Build only part I of N (0-based) of the inputs, a dataset of its own that `zaya data merge` "
                   "joins with the others; needs --tokenizer. 'slurm': the job array's task (SLURM_ARRAY_TASK_ID "
                   "from SLURM_ARRAY_TASK_MIN, of SLURM_ARRAY_TASK_COUNT); 'kubernetes/N': an indexed job's "
                   "JOB_COMPLETION_INDEX, of N.")
def build(tokenizer, workers, shard_tokens, overwrite, part, **corpus) -> None:
    """Tokenize text files into a dataset of token super-shards, a document index and a manifest."""
    if tokenizer is not None and corpus["vocab_size"] is not None:
        raise ZayaError("give --tokenizer or --vocab-size, not both")
    if tokenizer is not None:
        from zaya.tokenizer_source import tokenizer_file  # a run directory's too: through zaya.weights

        tokenizer = tokenizer_file(tokenizer)
    options = _options(**corpus, tokenizer=tokenizer, workers=workers, shard_tokens=shard_tokens, overwrite=overwrite,
                       part=None if part is None else _part(part))
    # the files skipped as soon as the inputs are found; the bad records, their summary and the splits at the end
    report = build_dataset(options, warn=lambda line: click.echo(f"zaya: warning: {line}", err=True))
    click.echo(_format(open_dataset(report.path)))
    click.echo(f"built in {report.seconds:.1f}s")


@data.command()
@_corpus_options
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), metavar="FILE",
              help="The tokenizer.json to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing file at --out.")
def tokenizer(overwrite, **corpus) -> None:
    """Train the BPE a build of these inputs would train, once, into a tokenizer.json: builds given it
    (`--tokenizer`) write the datasets a build that trains its own does, so that the parts of a corpus built on
    many machines share one tokenizer."""
    from zaya.data.build import build_tokenizer
    from zaya.owned import check_output, write_output

    options = _options(**corpus)
    check_output(options.out, overwrite)  # before the training, not after it
    trained, data = build_tokenizer(options)
    write_output(options.out, data, overwrite)
    click.echo(f"tokenizer    {options.out}: vocab {trained.get_vocab_size(with_added_tokens=True)}, "
               f"sha256 {hashlib.sha256(data).hexdigest()[:16]}")


def _part(text: str) -> tuple[int, int]:
    """`--part`: I/N, or the task of a Slurm job array, or the index of a Kubernetes indexed job."""
    import os

    if text == "slurm":
        names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
        values = [os.environ.get(name) for name in names]
        if not all(v is not None and v.isdigit() for v in values):
            raise ZayaError(f"--part slurm: {', '.join(names)} must be set (inside a job array), got {values}")
        task, first, count = (int(v) for v in values)
        return task - first, count
    if text.startswith("kubernetes/"):
        index, count = os.environ.get("JOB_COMPLETION_INDEX"), text.split("/", 1)[1]
        if index is None or not index.isdigit() or not count.isdigit():
            raise ZayaError(f"--part {text}: needs JOB_COMPLETION_INDEX set (an indexed job) and the number of "
                            "parts after the slash")
        return int(index), int(count)
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ZayaError(f"--part {text}: expected I/N with 0 <= I < N (0-based), 'slurm' or 'kubernetes/N'")
    return int(index), int(count)


@data.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="The dataset directory to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
@click.option("--onto", type=click.Path(path_type=Path), default=None, metavar="DATASET",
              help="Grow this dataset by the parts (a new crawl dump built with its tokenizer): --out is a new "
                   "version holding both, DATASET stays as it is.")
def merge(parts, out, overwrite, onto) -> None:
    """Join the parts of one build (`zaya data build --part I/N`) into one dataset, their token files
    hard-linked, not copied."""
    import time

    from zaya.data.merge import merge_parts

    started = time.perf_counter()
    report = merge_parts(parts, out, overwrite, onto)
    click.echo(_format(open_dataset(report.path)))
    copied = f", {report.copied} shards copied (another file system)" if report.copied else ""
    click.echo(f"merged {report.parts} parts in {time.perf_counter() - started:.1f}s: {report.tokens:,} tokens, "
               f"{report.documents:,} documents, {report.bad_records} bad records, "
               f"{report.shard_bytes / 1e6:.1f} MB of shards linked{copied}")


@data.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--verify", is_flag=True, help="Recompute every file's SHA-256 and compare with the manifest.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar for --verify [default: when stderr is a terminal].")
def inspect(directory, as_json, verify, progress) -> None:
    """Summarise a dataset's manifest; with --verify, check every checksum."""
    dataset = open_dataset(directory)
    summary = dataset.summary()
    if verify:
        checked = dataset.verify(progress=sys.stderr.isatty() if progress is None else progress)
        summary["verified_files"] = checked
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(_format(dataset))
    if verify:
        click.echo(f"verified     {summary['verified_files']} files: every checksum matches")


def _format(dataset: Dataset) -> str:
    summary = dataset.summary()
    tokenizer = summary["tokenizer"]
    corpus = summary["corpus"]
    lines = [
        f"dataset      {summary['path']}",
        f"fingerprint  {summary['fingerprint']}",
        f"tokenizer    {tokenizer['file']}: vocab {tokenizer['vocab_size']}, eos id {tokenizer['eos_id']}, "
        f"sha256 {tokenizer['sha256'][:16]}",
        f"tokens       {summary['num_tokens']:,} as {summary['dtype']} (largest id {summary['max_token_id']})",
    ]
    reserved = {token: i for token, i in tokenizer["special_ids"].items() if token not in SPECIAL_TOKENS}
    if reserved:
        lines.insert(3, "special      " + ", ".join(f"{token} {i}" for token, i in
                                                  sorted(reserved.items(), key=lambda item: item[1])))
    for name, split in summary["splits"].items():
        learned = f" ({split['loss_tokens']:,} learned)" if "loss_tokens" in split else ""
        lines.append(f"{name:<12} {split['num_tokens']:,} tokens{learned}, {split['num_documents']:,} documents, "
                     f"{split['shards']} shard{'s' if split['shards'] != 1 else ''}")
    if dataset.chat_template_path is not None:
        lines.append(f"chat         template {dataset.chat_template_path.name}, end of turn {dataset.end_of_turn}; "
                     "loss on the assistant turns only")
    files = _input_files(dataset)
    counted = "" if files is None else f"{files:,} files, "
    lines.append(f"corpus       {counted}{corpus.get('text_bytes', 0) / 1e6:.1f} MB of text, "
                 f"{corpus.get('bad_records', 0)} bad records skipped, {corpus.get('invalid_utf8_documents', 0)} "
                 "documents with invalid UTF-8")
    return "\n".join(lines)


def _input_files(dataset: Dataset) -> int | None:
    """How many files the dataset was built from: build.json says (older manifests held it too)."""
    if "files" in dataset.manifest["corpus"]:
        return dataset.manifest["corpus"]["files"]
    try:
        info = read_json_object(dataset.path / BUILD_FILE, "document", "a dataset's build.json")
        return Fields(info, dataset.path / BUILD_FILE).int("files", None, lo=0)
    except ZayaError:
        return None  # build.json is informative only (and bounded as it is read): a dataset without it is whole
