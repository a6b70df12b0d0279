"""Build throughput: `zaya data build` against the bare `tokenizers` batch encoder on the same text.

    python benchmarks/data_build.py                  # the default corpus, the standard library's source
    python benchmarks/data_build.py --input corpus/ --repeats 5

Both sides use the same tokenizer (an 8192-entry byte-level BPE trained on the corpus beforehand, not timed,
and loaded afresh for every run) and the same documents. The encoder is handed the texts already in memory
and only encodes them, with `encode_batch_fast` on all cores through the library's own thread pool. The
build is timed end to end: finding and reading the files, tokenizing in worker processes, writing the
super-shards, hashing every file, writing the manifest. The two alternate `--repeats` times and the best
time of each counts, which keeps other load on the machine from deciding the result.

Target: the build reaches at least 0.8x the encoder's megabytes of text per second.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
from tokenizers import Tokenizer

from common import header
from zaya.data.build import BuildOptions, build_dataset, default_workers
from zaya.data.corpus import ReadOptions, discover, read_piece, split_file

TARGET = 0.8


def _texts(inputs: tuple[str, ...]) -> list[str]:
    """The documents exactly as the build reads them."""
    texts = []
    for index, file in enumerate(discover(inputs)):
        for piece in split_file(file, index, ReadOptions(), 1 << 62):
            texts.extend(r.text for r in read_piece(file, piece, ReadOptions()).records if r.text is not None)
    return texts


@click.command()
@click.option("--input", "inputs", multiple=True, default=("stdlib",), show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--vocab-size", type=int, default=8192, show_default=True)
def main(inputs: tuple[str, ...], repeats: int, vocab_size: int) -> None:
    """Measure build throughput against the bare batch encoder."""
    header("data build throughput")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        started = time.perf_counter()
        first = build_dataset(BuildOptions(inputs=inputs, out=root / "trained", vocab_size=vocab_size))
        full_seconds = time.perf_counter() - started
        tokenizer_path = first.path / "tokenizer.json"
        texts = _texts(inputs)
        megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6

        encoder, builder = [], []
        for i in range(repeats):
            # a freshly loaded tokenizer, as the build's workers have: no encode cache carried between runs
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
            started = time.perf_counter()
            tokenizer.encode_batch_fast(texts)
            encoder.append(time.perf_counter() - started)
            started = time.perf_counter()
            build_dataset(BuildOptions(inputs=inputs, out=root / f"build{i}", tokenizer=tokenizer_path))
            builder.append(time.perf_counter() - started)

    encoder_rate, build_rate = megabytes / min(encoder), megabytes / min(builder)
    ratio = build_rate / encoder_rate
    click.echo(f"corpus: {', '.join(inputs)}: {len(texts)} documents, {megabytes:.1f} MB of text, "
               f"{first.manifest['splits']['train']['num_tokens'] + first.manifest['splits']['val']['num_tokens']:,}"
               f" tokens; {default_workers()} workers")
    click.echo(f"first build, training the {vocab_size}-entry BPE too: {full_seconds:.2f} s")
    click.echo(f"bare encoder (encode_batch_fast):  {encoder_rate:6.2f} MB/s   best of {repeats}: "
               f"{', '.join(f'{s:.2f}' for s in encoder)} s")
    click.echo(f"zaya data build (given tokenizer): {build_rate:6.2f} MB/s   best of {repeats}: "
               f"{', '.join(f'{s:.2f}' for s in builder)} s")
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    click.echo(f"ratio {ratio:.2f}x (target >= {TARGET}x): {verdict}")
    sys.exit(0 if ratio >= TARGET else 1)


if __name__ == "__main__":
    main()
