"""A dataset built in parts (`zaya data build --part I/N`) and merged (`zaya data merge`): the same token stream,
document index, val split, corpus facts and fingerprint as a one-machine build of the same inputs with the same
tokenizer (and so the same training run),
for 1, 3 and 7 parts (a line file large enough to be cut by byte range, a compressed file, a bad record, parts
that come out empty); and every merge that cannot be one dataset is one line that writes nothing."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest

from zaya.data.dataset_reader import open_dataset

SHARD_TOKENS = "50000"  # several shards a part, so that a merged stream crosses short shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    (root / "corpus").mkdir()
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    with open(root / "corpus" / "big.jsonl", "w") as handle:  # > 2 x 256 KiB: cut by byte range
        for i in range(4500):
            handle.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(14 + i % 19))}) + "\n")
            if i == 2500:
                handle.write("{a bad record\n")
    with gzip.open(root / "corpus" / "c.jsonl.gz", "wt") as handle:
        for i in range(150):
            text = f"compressed {i} " + " ".join(rng.choice(words) for _ in range(9))
            handle.write(json.dumps({"text": text}) + "\n")
    (root / "corpus" / "note.txt").write_text("a small text file of its own")
    return root


def _zaya(cli, *args):
    code, out, err = cli(*args)
    assert code == 0, err
    return out


def _content(path):
    dataset = open_dataset(path)
    content = {}
    for name in ("train", "val"):
        split = dataset.split(name)
        content[name] = (split.read(0, split.num_tokens).tolist(), np.asarray(split.document_ends()).tolist())
    return content, dataset.manifest["corpus"]


@pytest.fixture(scope="module")
def tokenizer(corpus):
    from zaya.cli import main

    assert main(["data", "tokenizer", "-i", str(corpus / "corpus"), "-o", str(corpus / "tok.json"),
                 "--vocab-size", "300"]) == 0
    assert main(["data", "build", "-i", str(corpus / "corpus"), "-o", str(corpus / "whole"), "--tokenizer",
                 str(corpus / "tok.json"), "--shard-tokens", SHARD_TOKENS, "--workers", "2"]) == 0
    return corpus / "tok.json"


def _parts(cli, corpus, tokenizer, count, tag=""):
    paths = []
    for i in range(count):
        path = corpus / f"{tag}p{count}.{i}"
        if not path.exists():
            _zaya(cli, "data", "build", "-i", corpus / "corpus", "-o", path, "--tokenizer", tokenizer, "--part",
                  f"{i}/{count}", "--shard-tokens", SHARD_TOKENS, "--workers", "1")
        paths.append(path)
    return paths


@pytest.mark.parametrize("count", [1, 3, 7])
def test_the_merged_parts_are_the_one_machine_build(cli, corpus, tokenizer, count):
    parts = _parts(cli, corpus, tokenizer, count)
    out = _zaya(cli, "data", "merge", *reversed(parts), "-o", corpus / f"merged{count}")  # any order
    assert f"merged {count} parts" in out and "1 bad records" in out
    whole, merged = _content(corpus / "whole"), _content(corpus / f"merged{count}")
    assert merged == whole
    assert open_dataset(corpus / f"merged{count}").fingerprint == open_dataset(corpus / "whole").fingerprint
    assert "verified" in _zaya(cli, "data", "inspect", corpus / f"merged{count}", "--verify")
    if count == 7:  # a short corpus's parts: some empty, the large file cut by byte range among the others
        sizes = [open_dataset(p).num_tokens for p in parts]
        assert 0 in sizes and sum(1 for n in sizes if n) >= 3
        # windows across the parts' short shards read as the one-machine build's
        a, b = open_dataset(corpus / "whole").split("train"), open_dataset(corpus / f"merged{count}").split("train")
        samples = np.arange(0, a.num_tokens // 129 - 1, 7)
        assert np.array_equal(a.gather(samples, 128), b.gather(samples, 128))


def test_the_parts_share_the_pieces_out_disjoint_and_in_order(corpus):
    """The large line file is cut by byte range across parts; the parts' pieces, in part order, are all the
    pieces in input order, each once."""
    from zaya.data.build_units import part_pieces
    from zaya.data.corpus import ReadOptions, Selection, discover
    from zaya.data.skipped import SkippedFiles

    files = discover((str(corpus / "corpus"),), Selection((), ()), None, SkippedFiles())
    read = ReadOptions("text", None, None)
    for count in (1, 3, 7):
        parts = [part_pieces(files, read, i, count) for i in range(count)]
        joined = [piece for part in parts for piece in part]
        assert [(p.file, p.start) for p in joined] == sorted((p.file, p.start) for p in joined)
        assert len({(p.file, p.start) for p in joined}) == len(joined)
        big = next(i for i, f in enumerate(files) if f.path.name == "big.jsonl")
        cut = {i for i, part in enumerate(parts) for p in part if p.file == big}
        assert len(cut) >= min(count, 2), (count, cut)


def test_a_part_rebuilt_is_the_same_bytes_from_any_working_directory(cli, corpus, tokenizer, monkeypatch):
    first = _parts(cli, corpus, tokenizer, 3)[1]
    monkeypatch.chdir(corpus / "corpus")
    _zaya(cli, "data", "build", "-i", ".", "-o", corpus / "again", "--tokenizer", tokenizer, "--part", "1/3",
          "--shard-tokens", SHARD_TOKENS, "--workers", "2")
    assert open_dataset(corpus / "again").fingerprint == open_dataset(first).fingerprint
    parts = _parts(cli, corpus, tokenizer, 3)
    _zaya(cli, "data", "merge", parts[0], corpus / "again", parts[2], "-o", corpus / "merged-again")
    assert _content(corpus / "merged-again") == _content(corpus / "whole")


def test_a_slurm_array_task_builds_its_part(cli, corpus, tokenizer, monkeypatch):
    for name, value in (("SLURM_ARRAY_TASK_ID", "3"), ("SLURM_ARRAY_TASK_MIN", "1"), ("SLURM_ARRAY_TASK_COUNT", "3")):
        monkeypatch.setenv(name, value)
    _zaya(cli, "data", "build", "-i", corpus / "corpus", "-o", corpus / "slurm", "--tokenizer", tokenizer, "--part",
          "slurm", "--shard-tokens", SHARD_TOKENS, "--workers", "1")
    assert open_dataset(corpus / "slurm").fingerprint == open_dataset(_parts(cli, corpus, tokenizer, 3)[2]).fingerprint


def test_merges_that_are_not_one_build_are_one_line_and_write_nothing(cli, corpus, tokenizer, tmp_path):
    parts = _parts(cli, corpus, tokenizer, 3)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "other.txt").write_text("another corpus altogether")
    _zaya(cli, "data", "build", "-i", tmp_path / "corpus", "-o", tmp_path / "listing", "--tokenizer", tokenizer,
          "--part", "1/3")
    _zaya(cli, "data", "tokenizer", "-i", corpus / "corpus", "-o", tmp_path / "tok2.json", "--vocab-size", "310")
    _zaya(cli, "data", "build", "-i", corpus / "corpus", "-o", tmp_path / "retokenized", "--tokenizer",
          tmp_path / "tok2.json", "--part", "1/3")
    cases = {
        "missing": ([parts[0], parts[2]], "part 1 of 3 is missing"),
        "twice": ([parts[0], parts[1], parts[1], parts[2]], "given twice"),
        "another listing": ([parts[0], tmp_path / "listing", parts[2]], "another build"),
        "another tokenizer": ([parts[0], tmp_path / "retokenized", parts[2]], "another build"),
        "not a part": ([corpus / "whole", parts[1]], "not a part of a build"),
    }
    for name, (given, said) in cases.items():
        code, _, err = cli("data", "merge", *given, "-o", tmp_path / "out")
        assert code != 0 and said in err and err.count("\n") == 1, (name, err)
        assert not (tmp_path / "out").exists(), name
    for args, said in ((["--part", "1/3"], "--part needs --tokenizer"),
                       (["--part", "3/3", "--tokenizer", tokenizer], "0 <= I < N"),
                       (["--part", "slurm", "--tokenizer", tokenizer], "SLURM_ARRAY_TASK_ID")):
        code, _, err = cli("data", "build", "-i", corpus / "corpus", "-o", tmp_path / "bad", *args)
        assert code != 0 and said in err and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()


def test_a_training_run_on_the_merged_parts_is_the_run_on_the_one_machine_build(cli, corpus, tokenizer, tmp_path):
    from runs import losses, write_config

    merged = corpus / "merged-train"
    if not merged.exists():
        _zaya(cli, "data", "merge", *_parts(cli, corpus, tokenizer, 3), "-o", merged)
    runs = []
    for name, dataset in (("whole", corpus / "whole"), ("merged", merged)):
        config = write_config(tmp_path / f"{name}.toml", dataset, train={"max_steps": 3, "eval_every": 3},
                              checkpoint={"every": 3, "keep": 1})
        _zaya(cli, "train", config, "--run-dir", tmp_path / name)
        runs.append(losses(tmp_path / name))
    assert runs[0] == runs[1] and len(runs[0]) == 3 and runs[0][-1][2] is not None


def test_a_dataset_grows_by_new_parts_into_a_new_version(cli, corpus, tokenizer, tmp_path):
    """A new crawl dump's parts merged onto a dataset: the new version holds the old stream, then the new one;
    the old dataset is untouched; parts of another tokenizer are refused."""
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "new.jsonl").write_text("".join(json.dumps({"text": f"fresh document {i} w1 w2"}) + "\n"
                                                         for i in range(40)))
    new = [tmp_path / f"new{i}" for i in range(2)]
    for i, path in enumerate(new):
        _zaya(cli, "data", "build", "-i", tmp_path / "dump", "-o", path, "--tokenizer", tokenizer, "--part",
              f"{i}/2", "--val-fraction", "0")
    old = corpus / "whole"
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    _zaya(cli, "data", "merge", *new, "--onto", old, "-o", tmp_path / "v2")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    old_train, old_ends = _content(old)[0]["train"]
    grown_train, grown_ends = _content(tmp_path / "v2")[0]["train"]
    assert grown_train[:len(old_train)] == old_train and len(grown_train) > len(old_train)
    assert grown_ends[:len(old_ends)] == old_ends and len(grown_ends) == len(old_ends) + 40
    assert open_dataset(tmp_path / "v2").fingerprint != open_dataset(old).fingerprint
    _zaya(cli, "data", "tokenizer", "-i", tmp_path / "dump", "-o", tmp_path / "other.json", "--vocab-size", "280")
    _zaya(cli, "data", "build", "-i", tmp_path / "dump", "-o", tmp_path / "alien", "--tokenizer",
          tmp_path / "other.json", "--part", "0/1")
    code, _, err = cli("data", "merge", tmp_path / "alien", "--onto", old, "-o", tmp_path / "v3")
    assert code != 0 and "tokenizer" in err and err.count("\n") == 1 and not (tmp_path / "v3").exists()
    code, _, err = cli("data", "merge", *new, "--onto", tmp_path / "v2", "-o", tmp_path / "v2", "--overwrite")
    assert code != 0 and "another directory" in err and err.count("\n") == 1


def test_a_part_killed_midway_and_built_again_is_the_part(corpus, tokenizer, tmp_path):
    """SIGKILL while the part's staging directory exists (the build under way): nothing at --out, and the
    rebuild (which clears the killed build's staging directory) writes the same bytes as a build left alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from zaya.owned import MARKER, staging_prefix

    big = tmp_path / "big"
    big.mkdir()
    rng = random.Random(1)
    with open(big / "a.jsonl", "w") as handle:  # a few MB: a second or more of tokenizing on one worker
        for i in range(30000):
            handle.write(json.dumps({"text": " ".join(f"w{rng.randrange(400)}" for _ in range(20 + i % 30))}) + "\n")
    args = [sys.executable, "-m", "zaya.cli", "data", "build", "-i", str(big), "--tokenizer", str(tokenizer),
            "--part", "0/2", "--workers", "1"]
    process = subprocess.Popen([*args, "-o", str(tmp_path / "part")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    staging = staging_prefix(tmp_path / "part")
    # under way: its staging directory made and marked as zaya's (a kill between the two leaves a directory that
    # no marker proves zaya's, which is left alone by design)
    while not any(p.name.startswith(staging) and _written(p / MARKER) for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and process.poll() is None, "the build ended before it could be killed"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "part").exists()
    for out in ("part", "alone"):
        assert subprocess.run([*args, "-o", str(tmp_path / out)], capture_output=True).returncode == 0
    assert open_dataset(tmp_path / "part").fingerprint == open_dataset(tmp_path / "alone").fingerprint
    assert not any(p.name.startswith(staging) for p in tmp_path.iterdir())  # the killed build's, cleared


def _written(path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def test_verify_checks_the_recorded_content_too(cli, corpus, tokenizer, tmp_path):
    """The fingerprint is taken over the content a split records: a shard changed and its checksum made to agree
    is still caught by `data inspect --verify`, naming the split and the stream."""
    import hashlib
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(corpus / "whole", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    data = bytearray((copy / shard["file"]).read_bytes())
    data[10] ^= 1
    (copy / shard["file"]).write_bytes(bytes(data))
    shard["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli("data", "inspect", copy, "--verify")
    assert code != 0 and "train split's tokens do not hash" in err and err.count("\n") == 1, err


def test_two_parts_built_at_once_by_two_processes_merge(corpus, tokenizer, tmp_path):
    import subprocess
    import sys

    runs = [subprocess.Popen([sys.executable, "-m", "zaya.cli", "data", "build", "-i", str(corpus / "corpus"),
                              "--tokenizer", str(tokenizer), "--part", f"{i}/2", "--shard-tokens", SHARD_TOKENS,
                              "--workers", "1", "-o", str(tmp_path / f"p{i}")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE) for i in range(2)]
    assert all(run.wait(timeout=120) == 0 for run in runs), [run.stderr.read() for run in runs]
    from zaya.data.merge import merge_parts

    report = merge_parts([tmp_path / "p1", tmp_path / "p0"], tmp_path / "merged")
    assert report.fingerprint == open_dataset(corpus / "whole").fingerprint and report.copied == 0
    assert _content(tmp_path / "merged") == _content(corpus / "whole")
