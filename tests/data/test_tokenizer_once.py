"""`zaya data tokenizer`: the BPE a build would train, trained alone, so that builds sharing it (the parts of a
corpus built on many machines) write the dataset a build that trains its own writes: the same fingerprint,
whatever the workers, for text and chat corpora whose sample is a share of each file."""

from __future__ import annotations

import gzip
import json

import pytest

from runs import make_chats, write_chats
from zaya.data.build import BuildOptions, build_dataset, build_tokenizer
from zaya.data.dataset_reader import open_dataset


def _text_corpus(root):
    root.mkdir()
    words = [f"w{i % 37}x{i % 11}" for i in range(4000)]
    with gzip.open(root / "a.jsonl.gz", "wt") as handle:
        for i in range(300):
            handle.write(json.dumps({"text": " ".join(words[i:i + 40 + i % 17])}) + "\n")
        handle.write("{not json\n")  # a bad record: skipped by the sample and the build alike
    (root / "b.txt").write_text(" ".join(reversed(words[:900])))
    (root / "c.csv").write_text("text\n" + "\n".join(f"row {i} " + " ".join(words[i::97][:30]) for i in range(80)))
    return root


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_build_given_the_tokenizer_trained_alone_is_the_build_that_trains_it(cli, tmp_path, kind):
    if kind == "text":
        corpus = [_text_corpus(tmp_path / "corpus")]
        options = ["--bpe-sample-mb", "1", "--vocab-size", "320"]
    else:
        corpus = [write_chats(tmp_path / "chats.jsonl", make_chats(60))]
        options = ["--format", "chat", "--vocab-size", "320"]
    code, out, err = cli("data", "tokenizer", "-i", *corpus, "-o", tmp_path / "tok.json", *options)
    assert code == 0, err
    assert "vocab 320" in out
    code, _, err = cli("data", "build", "-i", *corpus, "-o", tmp_path / "trained", "--workers", "1", *options)
    assert code == 0, err
    given = [o for o in options if o not in ("--vocab-size", "320")]
    code, _, err = cli("data", "build", "-i", *corpus, "-o", tmp_path / "given", "--workers", "2",
                       "--tokenizer", tmp_path / "tok.json", *given)
    assert code == 0, err
    trained, shared = open_dataset(tmp_path / "trained"), open_dataset(tmp_path / "given")
    assert shared.fingerprint == trained.fingerprint
    assert (tmp_path / "tok.json").read_bytes() == (tmp_path / "trained" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_sample_of_each_file_is_the_builds_whatever_its_workers(tmp_path, workers):
    """A sample smaller than the corpus (each file's first train documents, up to its share): the build's pieces
    depend on its workers, its sample does not."""
    corpus = _text_corpus(tmp_path / "corpus")
    options = BuildOptions(inputs=(str(corpus),), out=tmp_path / "d", vocab_size=320, workers=workers,
                           tokenizer_sample_bytes=20_000)
    alone = build_tokenizer(options)[1]
    report = build_dataset(options)
    assert (report.path / "tokenizer.json").read_bytes() == alone
    whole = build_tokenizer(BuildOptions(inputs=(str(corpus),), out=tmp_path / "d", vocab_size=320))[1]
    assert whole != alone  # the sample was a part of the corpus


def test_another_sample_trains_another_tokenizer(cli, tmp_path):
    """The sample is part of what the tokenizer is: a build must be given the options it was trained with."""
    corpus = _text_corpus(tmp_path / "corpus")
    for name, vocab in (("a", "320"), ("b", "330")):
        assert cli("data", "tokenizer", "-i", corpus, "-o", tmp_path / f"{name}.json", "--vocab-size", vocab)[0] == 0
    assert (tmp_path / "a.json").read_bytes() != (tmp_path / "b.json").read_bytes()


def test_the_tokenizer_file_is_never_replaced_unasked_and_bad_input_writes_nothing(cli, tmp_path):
    corpus = _text_corpus(tmp_path / "corpus")
    out = tmp_path / "tok.json"
    out.write_text("mine")
    code, _, err = cli("data", "tokenizer", "-i", corpus, "-o", out, "--vocab-size", "320")
    assert code != 0 and err.count("\n") == 1 and "already exists" in err and str(out) in err
    assert out.read_text() == "mine"
    assert cli("data", "tokenizer", "-i", corpus, "-o", out, "--vocab-size", "320", "--overwrite")[0] == 0
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    for args, said in ((["--vocab-size", "100"], "--vocab-size"), (["--val-fraction", "1.5"], "--val-fraction")):
        code, _, err = cli("data", "tokenizer", "-i", corpus, "-o", tmp_path / "new.json", *args)
        assert code != 0 and said in err and err.count("\n") == 1, err
    code, _, err = cli("data", "tokenizer", "-i", tmp_path / "missing", "-o", tmp_path / "new.json")
    assert code != 0 and err.count("\n") == 1 and "missing" in err
    assert not (tmp_path / "new.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "tok.json"]
