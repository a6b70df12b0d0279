"""A corpus built in N parts and merged, against one build of it: CPU time, wall time, merge time.

    python benchmarks/data_parts.py                         # a generated corpus of about 50 MB, N = 4
    python benchmarks/data_parts.py --input stdlib          # the standard library's source (3,190 small files)
    python benchmarks/data_parts.py --input corpus/ --parts 8 --parallel 4

The generated corpus (`--generate MB`, when no --input is given): four .jsonl files and a gzip-compressed one
of random words from a fixed vocabulary, the same bytes on every run.

Both sides use the same tokenizer, trained once beforehand (`zaya data tokenizer`, not timed). Measured:

- CPU time of the one build against the sum over the N parts (each part one worker, in this process, so the
  CPU time is the build's own, without an interpreter's start; the two alternate `--repeats` times and the
  best of each counts): the overhead of splitting, target within 5%;
- wall time of the N parts run `--parallel` at a time, each its own `zaya data build` process, against the one
  build on as many workers;
- the merge of the N parts (`zaya data merge`), and of parts cut into about `--shards` shard files in all
  (`--shard-tokens` small enough), the merge's cost per file;
- that the merged dataset has the one build's fingerprint.

Each part has a fixed cost besides its share of the work (finding every input file, loading the tokenizer,
writing its manifest): about 0.07 s with the standard library's 3,190 files, 7.5% of its 3.6 s build.
"""

from __future__ import annotations

import gzip
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from common import header
from zaya.data.build import BuildOptions, build_dataset, build_tokenizer
from zaya.data.dataset_reader import open_dataset
from zaya.data.merge import merge_parts

TARGET = 0.05


def _cpu() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _timed(fn) -> tuple[float, float, object]:
    """(CPU seconds, wall seconds, result) of fn()."""
    cpu, wall = _cpu(), time.perf_counter()
    result = fn()
    return _cpu() - cpu, time.perf_counter() - wall, result


def _generate(root: Path, megabytes: int) -> Path:
    """A deterministic corpus of about `megabytes` MB: four .jsonl files and a .jsonl.gz of random words."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    root.mkdir()
    per_file = megabytes * 1_000_000 // 5
    for i in range(5):
        name = root / (f"shard{i}.jsonl" if i < 4 else "extra.jsonl.gz")
        with (gzip.open(name, "wt") if i == 4 else open(name, "w")) as handle:
            written = 0
            while written < per_file:
                line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(30, 120)))}) + "\n"
                handle.write(line)
                written += len(line)
    return root


def _zaya(*args: object) -> list[str]:
    return [sys.executable, "-m", "zaya.cli", *(str(a) for a in args)]


@click.command()
@click.option("--input", "inputs", multiple=True, help="The corpus [default: a generated one].")
@click.option("--generate", type=click.IntRange(min=1), default=50, show_default=True,
              help="MB of the generated corpus, without --input.")
@click.option("--parts", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--parallel", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--shards", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--vocab-size", type=int, default=8192, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def main(inputs: tuple[str, ...], generate: int, parts: int, parallel: int, shards: int, vocab_size: int,
         repeats: int) -> None:
    """Measure a build in parts and its merge against one build."""
    header(f"data build in {parts} parts and merged, against one build")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        inputs = inputs or (str(_generate(root / "corpus", generate)),)
        tokenizer = root / "tokenizer.json"
        tokenizer.write_bytes(build_tokenizer(BuildOptions(inputs=inputs, out=root, vocab_size=vocab_size))[1])

        def build(out: Path, **options) -> Path:
            return build_dataset(BuildOptions(inputs=inputs, out=out, tokenizer=tokenizer, workers=1,
                                              **options)).path

        ones, part_sums = [], []
        for r in range(repeats):  # alternated, the best of each: other load on the machine does not decide
            cpu, _, one = _timed(lambda r=r: build(root / f"one{r}"))
            ones.append(cpu)
            part_sums.append(sum(_timed(lambda i=i, r=r: build(root / f"part{r}.{i}", part=(i, parts)))[0]
                                 for i in range(parts)))
        one_cpu, part_cpu = min(ones), min(part_sums)
        merge_cpu, merge_wall, _ = _timed(lambda: merge_parts([root / f"part0.{i}" for i in range(parts)],
                                                              root / "merged"))
        same = open_dataset(root / "merged").fingerprint == open_dataset(one).fingerprint
        tokens = open_dataset(one).num_tokens

        # wall time: the parts as processes, `parallel` at a time, against one build on `parallel` workers
        started = time.perf_counter()
        subprocess.run(_zaya("data", "build", "-i", *inputs, "--tokenizer", tokenizer, "--workers", parallel,
                             "--no-progress", "-o", root / "wide"), check=True, capture_output=True)
        wide_wall = time.perf_counter() - started
        started = time.perf_counter()
        running: list[subprocess.Popen] = []
        for i in range(parts):
            if len(running) == parallel:
                running.pop(0).wait()
            running.append(subprocess.Popen(_zaya("data", "build", "-i", *inputs, "--tokenizer", tokenizer,
                                                  "--part", f"{i}/{parts}", "--workers", 1, "--no-progress", "-o",
                                                  root / f"run{i}"), stdout=subprocess.DEVNULL))
        for process in running:
            process.wait()
        parts_wall = time.perf_counter() - started

        shard_tokens = max(1, tokens // shards)
        for i in range(parts):
            build(root / f"small{i}", part=(i, parts), shard_tokens=shard_tokens)
        files = sum(len(open_dataset(root / f"small{i}").files()) for i in range(parts))
        _, many_wall, report = _timed(lambda: merge_parts([root / f"small{i}" for i in range(parts)],
                                                          root / "many"))
        many_same = report.fingerprint == open_dataset(one).fingerprint

    overhead = part_cpu / one_cpu - 1
    corpus = ", ".join(inputs) if not inputs[0].startswith(scratch) else f"generated, {generate} MB"
    click.echo(f"corpus: {corpus}: {tokens:,} tokens; tokenizer of {vocab_size} trained once, not timed")
    verdict = "PASS" if abs(overhead) <= TARGET else "FAIL"
    click.echo(f"CPU time, one worker each, best of {repeats}: one build {one_cpu:.2f} s, {parts} parts "
               f"{part_cpu:.2f} s in all: "
               f"overhead {overhead:+.1%} (target within {TARGET:.0%}): {verdict}")
    click.echo(f"wall time: one build on {parallel} workers {wide_wall:.2f} s; {parts} parts as processes, "
               f"{parallel} at a time, {parts_wall:.2f} s (interpreter starts included)")
    click.echo(f"merge of the {parts} parts: {merge_wall:.3f} s wall, {merge_cpu:.3f} s CPU; same fingerprint as "
               f"the one build: {same}")
    click.echo(f"merge of {parts} parts holding {files:,} files ({shard_tokens:,} tokens a shard): {many_wall:.3f} s; "
               f"same fingerprint: {many_same}")
    sys.exit(0 if same and many_same and abs(overhead) <= TARGET else 1)


if __name__ == "__main__":
    main()
