import itertools
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zaya import reading as reading_module
from zaya.data import build as build_module
from zaya.data import build_units as build_units_module
from zaya.data import build_worker as build_worker_module
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.dataset_reader import open_dataset
from zaya.data.shards import BUILD_FILE
from zaya.errors import ZayaError


def _build(tmp_path, name, inputs, **kwargs):
    kwargs.setdefault("vocab_size", 300)
    kwargs.setdefault("workers", 1)
    return build_dataset(BuildOptions(inputs=tuple(str(i) for i in inputs), out=tmp_path / name, **kwargs))


def _documents(dataset, split):
    """The documents of a split as token lists, cut at the document index."""
    tokens = dataset.split(split)
    ends = tokens.document_ends().tolist()
    stream = tokens.read(0, tokens.num_tokens).tolist()
    return [stream[a:b] for a, b in itertools.pairwise([0, *ends])]


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".partial-" in p.name or ".old-" in p.name]


@pytest.fixture
def corpus(tmp_path, synthetic_documents, write_corpus):
    docs = synthetic_documents(120, seed=1)
    return write_corpus(tmp_path / "corpus", docs), docs


@pytest.fixture
def small_pieces(monkeypatch):
    """Cut even a small corpus into many units of work, and record how many processes ran them."""
    monkeypatch.setattr(build_units_module, "_MIN_PIECE_BYTES", 2048)
    pools = []
    mapper = build_module._mapper

    def recording_mapper(workers):
        pools.append(workers)
        return mapper(workers)

    monkeypatch.setattr(build_module, "_mapper", recording_mapper)
    return pools


def test_builds_are_deterministic_across_workers_places_and_processes(tmp_path, corpus, small_pieces):
    root, _ = corpus
    one = _build(tmp_path, "one", [root], val_fraction=0.2)
    two = _build(tmp_path, "two", [root], val_fraction=0.2, workers=2)
    assert small_pieces == [1, 2]
    assert one.fingerprint == two.fingerprint
    names = sorted(p.name for p in (tmp_path / "one").iterdir() if p.name != BUILD_FILE)
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # a third build in a fresh interpreter trains its own tokenizer: BPE training is deterministic too
    script = "import sys; from zaya.data_cli import data; data.main(sys.argv[1:], standalone_mode=False)"
    subprocess.run([sys.executable, "-c", script, "build", "--input", str(root), "--out", str(tmp_path / "three"),
                    "--vocab-size", "300", "--val-fraction", "0.2", "--no-progress"],
                   check=True, capture_output=True)
    assert open_dataset(tmp_path / "three").fingerprint == one.fingerprint


def test_every_document_is_kept_once_and_ends_with_eos(tmp_path, corpus):
    root, docs = corpus
    report = _build(tmp_path, "d", [root], val_fraction=0.2)
    dataset = open_dataset(report.path)
    tokenizer = Tokenizer.from_file(str(dataset.tokenizer_path))
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<pad>", "<eos>", "<bos>"]
    assert dataset.vocab_size == 300 and dataset.eos_id == 1
    decoded = {}
    for split in ("train", "val"):
        documents = _documents(dataset, split)
        assert all(doc[-1] == 1 and 1 not in doc[:-1] for doc in documents)
        decoded[split] = [tokenizer.decode(doc[:-1]) for doc in documents]
    assert 0 < len(decoded["val"]) < len(decoded["train"])
    # the split is by document; each split keeps the corpus order
    for split in ("train", "val"):
        positions = [docs.index(text) for text in decoded[split]]
        assert positions == sorted(positions)
    assert sorted(decoded["train"] + decoded["val"]) == sorted(docs)
    corpus_facts = dataset.manifest["corpus"]
    assert corpus_facts["documents"] == len(docs) == dataset.num_documents
    assert corpus_facts["text_bytes"] == sum(len(d.encode()) for d in docs)
    assert dataset.max_token_id < dataset.vocab_size
    dataset.check_vocab(512)  # a model vocabulary larger than the tokenizer's is fine
    with pytest.raises(ZayaError, match=f"token id {dataset.max_token_id} does not fit the model's vocabulary of 256"):
        dataset.check_vocab(256)


def test_super_shards_hold_the_same_stream(tmp_path, corpus):
    root, _ = corpus
    whole = open_dataset(_build(tmp_path, "whole", [root], val_fraction=0.0).path)
    sharded = open_dataset(_build(tmp_path, "sharded", [root], val_fraction=0.0, shard_tokens=1000).path)
    assert len(sharded.entries["train"].shards) > 5
    n = whole.split("train").num_tokens
    assert np.array_equal(whole.split("train").read(0, n), sharded.split("train").read(0, n))


def test_long_documents_are_tokenized_in_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(build_worker_module, "_PART_CHARS", 300)
    text = "".join(f"line {i} of a long document\n" for i in range(400))
    (tmp_path / "long.txt").write_text(text)
    dataset = open_dataset(_build(tmp_path, "d", [tmp_path / "long.txt"], val_fraction=0.0).path)
    [document] = _documents(dataset, "train")
    assert document.count(1) == 1 and document[-1] == 1
    assert Tokenizer.from_file(str(dataset.tokenizer_path)).decode(document[:-1]) == text


def _jsonl_with_bad_lines(path: Path, docs: list[str]) -> Path:
    lines = [json.dumps({"text": d}) for d in docs]
    lines[2] = "{broken"
    lines[5] = json.dumps({"content": "wrong field"})
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_records_are_skipped_and_reported(tmp_path, synthetic_documents, small_pieces, workers):
    path = _jsonl_with_bad_lines(tmp_path / "data.jsonl", synthetic_documents(40))
    report = _build(tmp_path, "d", [path], workers=workers)
    assert small_pieces == [workers]
    assert report.bad_records == 2
    assert report.problems[0].startswith(f"{path}:3: not valid JSON")
    assert report.problems[1] == f"{path}:6: no field 'text'"
    assert open_dataset(report.path).manifest["corpus"]["documents"] == 38
    assert json.loads((report.path / BUILD_FILE).read_text())["problems"] == report.problems


@pytest.mark.parametrize(("trained", "workers"), [(True, 1), (False, 1), (False, 2)])
def test_strict_mode_stops_at_the_first_bad_record_and_writes_nothing(tmp_path, synthetic_documents,
                                                                      tokenizer_file, small_pieces, trained,
                                                                      workers):
    path = _jsonl_with_bad_lines(tmp_path / "data.jsonl", synthetic_documents(40))
    extra = {} if trained else {"tokenizer": tokenizer_file}
    with pytest.raises(ZayaError, match=f"^{path}:3: not valid JSON"):
        _build(tmp_path, "d", [path], strict=True, workers=workers, **extra)
    assert small_pieces == ([] if trained else [workers])  # a trained tokenizer meets the line first
    assert not (tmp_path / "d").exists() and _leftovers(tmp_path) == []


def test_invalid_utf8_is_counted_and_never_fatal(tmp_path, synthetic_documents):
    good = synthetic_documents(10)
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(good):
        (tmp_path / "in" / f"{i}.txt").write_text(doc)
    (tmp_path / "in" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    report = _build(tmp_path, "d", [tmp_path / "in"])
    assert report.invalid_utf8_documents == 1
    assert report.problems == [f"{tmp_path / 'in' / 'latin1.txt'}: invalid UTF-8, replaced by U+FFFD"]
    assert open_dataset(report.path).manifest["corpus"]["documents"] == 11


def test_inputs_without_documents(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("")
    (tmp_path / "in" / "b.jsonl").write_text("\n\n")
    with pytest.raises(ZayaError, match=r"no documents in the inputs \(2 files"):
        _build(tmp_path, "d", [tmp_path / "in"], tokenizer=None)
    with pytest.raises(ZayaError, match="no inputs given"):
        _build(tmp_path, "d", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_an_unreadable_file_stops_the_build(tmp_path, synthetic_documents, tokenizer_file, monkeypatch):
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(synthetic_documents(5)):
        (tmp_path / "in" / f"{i}.txt").write_text(doc)
    real_open = os.open

    def failing_open(path, *args, **kwargs):  # inputs are opened as zaya.reading opens any file
        if Path(path).name == "3.txt":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(reading_module.os, "open", failing_open)
    with pytest.raises(ZayaError, match=r"3\.txt: cannot read \(permission denied\)$"):
        _build(tmp_path, "d", [tmp_path / "in"], tokenizer=tokenizer_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="file permissions do not stop root")
def test_a_file_without_read_permission(tmp_path, synthetic_documents, tokenizer_file):
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(synthetic_documents(5)):
        (tmp_path / "in" / f"{i}.txt").write_text(doc)
    (tmp_path / "in" / "2.txt").chmod(0)
    with pytest.raises(ZayaError, match=r"2\.txt: cannot read \(permission denied\)"):
        _build(tmp_path, "d", [tmp_path / "in"], tokenizer=tokenizer_file, workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_given_tokenizer_is_copied_and_its_eos_used(tmp_path, corpus, tokenizer_file):
    root, _ = corpus
    report = _build(tmp_path, "d", [root], tokenizer=tokenizer_file)
    assert (report.path / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    custom = Tokenizer(models.BPE())
    custom.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    custom.decoder = decoders.ByteLevel()
    custom.train_from_iterator(["some text"] * 10, trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    custom.save(str(tmp_path / "custom.json"))
    with pytest.raises(ZayaError, match=r"custom\.json: no '<eos>' token; name the end-of-document token"):
        _build(tmp_path, "e", [root], tokenizer=tmp_path / "custom.json")
    dataset = open_dataset(_build(tmp_path, "e", [root], tokenizer=tmp_path / "custom.json", eos_token="</s>").path)
    assert dataset.eos_id == 1 and _documents(dataset, "train")[0][-1] == 1


def test_an_existing_output_needs_overwrite(tmp_path, corpus, tokenizer_file):
    root, _ = corpus
    first = _build(tmp_path, "d", [root], tokenizer=tokenizer_file)
    with pytest.raises(ZayaError, match="already exists; pass --overwrite"):
        _build(tmp_path, "d", [root], tokenizer=tokenizer_file)
    again = _build(tmp_path, "d", [root], tokenizer=tokenizer_file, overwrite=True)
    assert again.fingerprint == first.fingerprint and _leftovers(tmp_path) == []


@pytest.fixture
def real_sources(tmp_path):
    """The json package's source as .txt files (named .py files are only read through 'stdlib')."""
    (tmp_path / "src").mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (tmp_path / "src" / f"{source.stem}.txt").write_bytes(source.read_bytes())
    return tmp_path / "src"


def test_real_source_files(tmp_path, real_sources):
    files = sorted(real_sources.iterdir())
    report = _build(tmp_path, "d", [real_sources], vocab_size=1024, val_fraction=0.0, workers=2)
    dataset = open_dataset(report.path)
    assert dataset.num_documents == len(files)
    tokenizer = Tokenizer.from_file(str(dataset.tokenizer_path))
    first = _documents(dataset, "train")[0]
    assert tokenizer.decode(first[:-1]) == files[0].read_text(encoding="utf-8")
    assert dataset.num_tokens < sum(p.stat().st_size for p in files) / 2  # BPE compresses source code


def test_the_bpe_can_learn_from_a_sample(tmp_path, real_sources):
    paragraphs = [p for source in sorted(real_sources.iterdir()) for p in source.read_text().split("\n\n")]
    corpus = tmp_path / "paragraphs.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs if p.strip()))
    full = _build(tmp_path, "full", [corpus], vocab_size=2048)
    sampled = _build(tmp_path, "sampled", [corpus], vocab_size=2048, tokenizer_sample_bytes=8192)
    assert open_dataset(full.path).vocab_size == 2048
    # the first 8 KB of paragraphs have too few distinct pairs for 2048 entries
    assert open_dataset(sampled.path).vocab_size < 2048
    assert open_dataset(sampled.path).num_documents == open_dataset(full.path).num_documents


def test_progress_bars_go_to_stderr(tmp_path, corpus, tokenizer_file, capsys):
    root, _ = corpus
    _build(tmp_path, "d", [root], tokenizer=tokenizer_file, progress=True)
    captured = capsys.readouterr()
    assert "tokenizing" in captured.err and captured.out == ""

