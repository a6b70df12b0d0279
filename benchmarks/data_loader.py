"""Loader throughput: random-order batches of 8 x 2048 from `TokenLoader` against a plain sequential read of
the same number of token bytes from a memory map.

    python benchmarks/data_loader.py [--tokens 134217728] [--batches 4000] [--repeats 3]

A dataset of `--tokens` random uint16 tokens is written with the dataset writer into a temporary directory.
Both sides produce the int64 [8, 2049] tensors a training step takes: the baseline by slicing consecutive
8 x 2049-token runs of the shard's memory map and converting them; the loader through the global order
(two-level block shuffle, background read-ahead). Both keep their memory maps across runs and first run
once untimed over the data, so both read from the page cache through mapped pages; then they alternate
`--repeats` times and the best run of each counts.
Targets: the loader reaches at least 0.5x the sequential read, and at least 10 million tokens per second.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

from common import header
from zaya.data.dataset_reader import Dataset, open_dataset
from zaya.data.dataset_writer import DatasetWriter
from zaya.data.loader import TokenLoader
from zaya.data.shards import token_dtype
from zaya.data.tokenizer import describe, tokenizer_bytes, train_bpe

BATCH, SEQ_LEN = 8, 2048
TARGET_RATIO = 0.5
TARGET_TOKENS_PER_SECOND = 10e6


def _write_dataset(path: Path, num_tokens: int) -> None:
    tokenizer = train_bpe(["a small tokenizer for a synthetic dataset of random token ids"] * 4, 512)
    data = tokenizer_bytes(tokenizer)
    info = describe(tokenizer, data, "benchmark")
    path.mkdir()
    writer = DatasetWriter(path, token_dtype(info.vocab_size))
    rng = np.random.default_rng(0)
    step = 1 << 24
    for start in range(0, num_tokens, step):
        tokens = rng.integers(0, info.vocab_size, min(step, num_tokens - start), dtype=np.uint16)
        writer.write("train", tokens, np.array([len(tokens)]))
    corpus = {"files": 0, "text_bytes": 0, "documents": 0, "bad_records": 0, "invalid_utf8_documents": 0}
    writer.finish(data, info.to_dict(), corpus)


def _sequential(tokens: np.ndarray, batches: int) -> float:
    size = BATCH * (SEQ_LEN + 1)
    started = time.perf_counter()
    for b in range(batches):
        batch = torch.from_numpy(tokens[b * size:(b + 1) * size].astype(np.int64)).view(BATCH, SEQ_LEN + 1)
    elapsed = time.perf_counter() - started
    assert batch.shape == (BATCH, SEQ_LEN + 1)
    return elapsed


def _loader(dataset: Dataset, batches: int, seed: int) -> float:
    with TokenLoader([(dataset, 1.0)], seq_len=SEQ_LEN, seed=seed) as loader:
        started = time.perf_counter()
        for _ in range(batches):
            batch = loader.next_batch(BATCH)
        elapsed = time.perf_counter() - started
    assert batch.shape == (BATCH, SEQ_LEN + 1)
    return elapsed


@click.command()
@click.option("--tokens", type=click.IntRange(min=1 << 20), default=1 << 27, show_default=True)
@click.option("--batches", type=click.IntRange(min=1), default=4000, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def main(tokens: int, batches: int, repeats: int) -> None:
    """Measure loader throughput against a sequential memory-map read."""
    header("data loader throughput")
    batches = min(batches, tokens // (BATCH * (SEQ_LEN + 1)))
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "synthetic"
        _write_dataset(path, tokens)
        dataset = open_dataset(path)
        mapped = np.asarray(np.memmap(path / dataset.entries["train"].shards[0].file, dtype=np.uint16, mode="r"))
        # both keep their memory maps across runs, and the first runs map every page they will need
        _sequential(mapped, tokens // (BATCH * (SEQ_LEN + 1)))
        _loader(dataset, batches * 2, seed=0)
        sequential, loader = [], []
        for repeat in range(repeats):
            sequential.append(_sequential(mapped, batches))
            loader.append(_loader(dataset, batches, seed=repeat + 1))

    moved = batches * BATCH * (SEQ_LEN + 1)
    sequential_rate, loader_rate = moved / min(sequential), moved / min(loader)
    ratio = loader_rate / sequential_rate
    click.echo(f"dataset: {tokens:,} random uint16 tokens; {batches} batches of {BATCH} x {SEQ_LEN + 1} "
               f"({moved:,} tokens) per run")
    click.echo(f"sequential memmap read: {sequential_rate / 1e6:8.1f} M tokens/s   best of {repeats}")
    click.echo(f"TokenLoader (shuffled): {loader_rate / 1e6:8.1f} M tokens/s   best of {repeats}")
    passed = ratio >= TARGET_RATIO and loader_rate >= TARGET_TOKENS_PER_SECOND
    click.echo(f"ratio {ratio:.2f}x (target >= {TARGET_RATIO}x), {loader_rate / 1e6:.0f} M tokens/s "
               f"(target >= {TARGET_TOKENS_PER_SECOND / 1e6:.0f} M): {'PASS' if passed else 'FAIL'}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
