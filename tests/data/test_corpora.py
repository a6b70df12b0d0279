"""Corpora as they come: every input kind builds the same dataset as the same documents in a .jsonl file or as
.txt files, bad records and damaged files are reported by file and line, and memory stays bounded."""

import csv
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from zaya.data import build_worker as build_worker_module
from zaya.data import compressed as compressed_module
from zaya.data import json_array as json_array_module
from zaya.data import records as records_module
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.corpus import ReadOptions, Selection, discover, location, read_piece, split_file
from zaya.data.dataset_reader import open_dataset
from zaya.data.shards import BUILD_FILE
from zaya.data_cli import data
from zaya.errors import ZayaError

pa = pytest.importorskip("pyarrow")
zstandard = pytest.importorskip("zstandard")

# documents that trip up parsers: delimiters, quotes, brackets and escapes, line ends, tabs, blank-looking text
TRICKY = [
    'a "quoted" word, a comma; and a backslash \\ here\n',
    "brackets [ { ] } inside text, and \"\\\"escaped\\\"\" quotes\n",
    "tabs\tbetween\tcells\r\nand a Windows line end\r\n",
    "ünïcödé text 日本語 and an emoji 🙂\n",
    "  \t ",  # only whitespace: a document in JSON and tables (it is not empty), none as a text file
    "",  # empty: no document anywhere
    "a long line of words " * 3000 + "\n",  # longer than the readers' blocks when the tests make them small
]


WORDS = ("alpha", "beta", "gamma", "delta", "def", "return", "class", "yield", "ünïcödé", "日本語", "{", "}", "[",
         "]", ",", '"', "\\", "\t")


def _documents() -> list[str]:
    """Deterministic pseudo-text documents of a few hundred characters, with the tricky ones among them."""
    docs = []
    for d in range(60):
        lines = [" ".join(WORDS[(d * 7 + line * 3 + w * w) % len(WORDS)] for w in range(3 + (d + line) % 9))
                 for line in range(2 + d % 6)]
        docs.append("\n".join(lines) + "\n")
    return docs[:20] + TRICKY + docs[20:]


@pytest.fixture
def documents():
    return _documents()


_SAVE_DATASETS = textwrap.dedent("""
    import json, sys
    from datasets import Dataset, DatasetDict
    docs, root = json.load(open(sys.argv[1])), sys.argv[2]
    table = Dataset.from_dict({"body": docs, "id": list(range(len(docs)))})
    table.save_to_disk(f"{root}/saved", num_shards=3)
    DatasetDict({"test": Dataset.from_dict({"body": ["not this split"], "id": [0]}), "train": table}).save_to_disk(
        f"{root}/dict")
    small = Dataset.from_dict({"text": ["one", "two", "three"]})
    small.save_to_disk(f"{root}/small", num_shards=2)
    DatasetDict({"train": small, "validation": small.select([2])}).save_to_disk(f"{root}/small_dict")
""")


@pytest.fixture(scope="session")
def saved_datasets(tmp_path_factory) -> Path:
    """Directories written by the `datasets` library itself: `saved` and `dict` (a DatasetDict whose train
    split is `saved`) hold the test documents in a column `body`; `small` and `small_dict` three rows of `text`.

    Written in a fresh interpreter, so that the test run's own process never imports `datasets`: the builds
    under test must read these directories without it."""
    root = tmp_path_factory.mktemp("saved_datasets")
    (root / "docs.json").write_text(json.dumps(_documents()))
    result = subprocess.run([sys.executable, "-c", _SAVE_DATASETS, str(root / "docs.json"), str(root)], cwd=root,
                            capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    if result.returncode != 0:
        if "No module named 'datasets'" in result.stderr:
            pytest.skip("the datasets library is not installed")
        raise AssertionError(result.stderr)
    return root


def _build(tmp_path, name, inputs, **kwargs):
    kwargs.setdefault("vocab_size", 300)
    kwargs.setdefault("workers", 1)
    return build_dataset(BuildOptions(inputs=tuple(str(i) for i in inputs), out=tmp_path / name, **kwargs))


def _same_dataset(a, b):
    """The same fingerprint and byte-identical files (build.json aside: it records how each was built)."""
    assert a.fingerprint == b.fingerprint
    names = sorted(p.name for p in a.path.iterdir() if p.name != BUILD_FILE)
    assert names == sorted(p.name for p in b.path.iterdir() if p.name != BUILD_FILE)
    for name in names:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name


def _jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _txt_dir(path: Path, docs, suffix=".txt") -> Path:
    path.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (path / f"doc{i:03d}{suffix}").write_bytes(doc.encode("utf-8"))
    return path


def _zstd(data: bytes, **kwargs) -> bytes:
    return zstandard.ZstdCompressor(**kwargs).compress(data)


def _csv(path: Path, docs, delimiter=",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(["id", "text", "note"])
        for i, doc in enumerate(docs):
            writer.writerow([i, doc, "n"])
    return path


def _arrow(path: Path, docs, *, stream: bool, batch_rows: int = 9) -> Path:
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    sink = pa.OSFile(str(path), "wb")
    writer = pa.ipc.new_stream(sink, schema) if stream else pa.ipc.new_file(sink, schema)
    for start in range(0, len(docs), batch_rows):
        part = docs[start:start + batch_rows]
        writer.write_batch(pa.record_batch([pa.array(range(start, start + len(part))), pa.array(part)], schema))
    writer.close()
    sink.close()
    return path


# ---- the same documents, whatever the packaging -------------------------------------------------------------


RECORD_KINDS = ["jsonl.gz", "jsonl.zst", "jsonl.zstd multi-frame", "json array", "json lines", "csv", "tsv",
                "csv.gz", "arrow stream", "arrow file", "datasets", "datasetdict", "parquet"]


def _write_records(kind: str, root: Path, docs, saved: Path) -> tuple[list[Path], dict]:
    """The documents as input(s) of `kind`, and the build options reading them needs."""
    raw = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode("utf-8")
    if kind == "jsonl.gz":
        (root / "a.jsonl.gz").write_bytes(gzip.compress(raw))
        return [root / "a.jsonl.gz"], {}
    if kind == "jsonl.zst":
        (root / "a.jsonl.zst").write_bytes(_zstd(raw, write_checksum=True))
        return [root / "a.jsonl.zst"], {}
    if kind == "jsonl.zstd multi-frame":  # as parallel compressors write them: frames cut mid-line
        cut = len(raw) // 3
        (root / "a.jsonl.zstd").write_bytes(_zstd(raw[:cut]) + _zstd(raw[cut:]))
        return [root / "a.jsonl.zstd"], {}
    if kind == "json array":
        (root / "a.json").write_text(json.dumps([{"text": d, "meta": {"n": [i]}} for i, d in enumerate(docs)],
                                                indent=1), encoding="utf-8")
        return [root / "a.json"], {}
    if kind == "json lines":
        (root / "a.json").write_bytes(raw)
        return [root / "a.json"], {}
    if kind in ("csv", "tsv"):
        return [_csv(root / f"a.{kind}", docs, "," if kind == "csv" else "\t")], {}
    if kind == "csv.gz":
        _csv(root / "a.csv", docs)
        (root / "a.csv.gz").write_bytes(gzip.compress((root / "a.csv").read_bytes()))
        return [root / "a.csv.gz"], {}
    if kind.startswith("arrow"):
        return [_arrow(root / "a.arrow", docs, stream=kind == "arrow stream")], {}
    if kind == "datasets":
        return [saved / "saved"], {"text_field": "body"}
    if kind == "datasetdict":
        return [saved / "dict"], {"text_field": "body"}
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": docs}), root / "a.parquet", row_group_size=7)
    return [root / "a.parquet"], {}


@pytest.mark.parametrize("kind", RECORD_KINDS)
def test_every_record_format_builds_the_jsonl_dataset(tmp_path, documents, kind, monkeypatch, request):
    # small blocks, so that records straddle the decompressor's, the JSON scanner's and the parser's reads
    for name in ("_BLOCK", "_MAX_BLOCK", "_OUTPUT"):
        monkeypatch.setattr(compressed_module, name, 1024)
    monkeypatch.setattr(json_array_module, "_BLOCK", 4096)
    monkeypatch.setattr(records_module, "_BLOCK", 1000)
    saved = request.getfixturevalue("saved_datasets") if kind.startswith("dataset") else None
    reference = _build(tmp_path, "reference", [_jsonl(tmp_path / "a.jsonl", documents)], val_fraction=0.2)
    (tmp_path / "in").mkdir()
    inputs, options = _write_records(kind, tmp_path / "in", documents, saved)
    built = _build(tmp_path, "built", inputs, val_fraction=0.2, **options)
    _same_dataset(open_dataset(reference.path), open_dataset(built.path))
    assert built.bad_records == 0 and built.manifest["corpus"]["documents"] == len(documents) - 1


def test_text_kinds_build_the_txt_dataset(tmp_path, documents):
    reference = _build(tmp_path, "reference", [_txt_dir(tmp_path / "txt", documents)])
    # --include: any extension, read as text; a matched file of a known kind is read by its kind
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i, doc in enumerate(documents):
        (mixed / f"doc{i:03d}{'.py' if i % 2 else '.md'}").write_bytes(doc.encode("utf-8"))
    (mixed / "skipped.jsonl").write_text(json.dumps({"text": "not included"}) + "\n")
    included = _build(tmp_path, "included", [mixed], include=("*.py", "*.md"))
    _same_dataset(open_dataset(reference.path), open_dataset(included.path))

    compressed = tmp_path / "compressed"
    compressed.mkdir()
    for i, doc in enumerate(documents):
        data = doc.encode("utf-8")
        name, payload = ((f"doc{i:03d}.txt.gz", gzip.compress(data)) if i % 2 else
                         (f"doc{i:03d}.txt.zst", _zstd(data)))
        (compressed / name).write_bytes(payload)
    _same_dataset(open_dataset(reference.path), open_dataset(_build(tmp_path, "compressed.out", [compressed]).path))


def test_compressed_text_with_a_separator(tmp_path, documents, monkeypatch):
    for name in ("_BLOCK", "_MAX_BLOCK", "_OUTPUT"):
        monkeypatch.setattr(compressed_module, name, 512)
    monkeypatch.setattr(records_module, "_BLOCK", 500)
    separator = "<|end|>"
    joined = (separator.join(documents) + separator).encode("utf-8")
    (tmp_path / "all.txt").write_bytes(joined)
    (tmp_path / "all.txt.gz").write_bytes(gzip.compress(joined))
    plain = _build(tmp_path, "plain", [tmp_path / "all.txt"], doc_separator=separator)
    packed = _build(tmp_path, "packed", [tmp_path / "all.txt.gz"], doc_separator=separator)
    _same_dataset(open_dataset(plain.path), open_dataset(packed.path))


def test_many_streamed_pieces_over_workers_and_buffers(tmp_path, documents, monkeypatch):
    """Several compressed files spread over two workers, each tokenized in many small buffers, build the
    dataset one worker builds from the plain file."""
    reference = _build(tmp_path, "reference", [_jsonl(tmp_path / "all.jsonl", documents * 3)])
    (tmp_path / "shards").mkdir()
    docs = documents * 3
    for shard in range(5):
        part = docs[shard * len(docs) // 5:(shard + 1) * len(docs) // 5]
        raw = _jsonl(tmp_path / "part.jsonl", part).read_bytes()
        name = f"part{shard}.jsonl.gz" if shard % 2 else f"part{shard}.jsonl.zst"
        (tmp_path / "shards" / name).write_bytes(gzip.compress(raw) if shard % 2 else _zstd(raw))
    monkeypatch.setattr(build_worker_module, "_BUFFER_BYTES", 2000)
    monkeypatch.setattr(build_worker_module, "_ENCODE_CHARS", 500)
    spread = _build(tmp_path, "spread", [tmp_path / "shards"], workers=2)
    _same_dataset(open_dataset(reference.path), open_dataset(spread.path))
    assert json.loads((spread.path / BUILD_FILE).read_text())["files"] == 5
    assert not any(p.name.startswith(".") for p in spread.path.iterdir())  # the workers' token files are gone


# ---- finding the files ---------------------------------------------------------------------------------------


def test_patterns():
    selection = Selection(include=("*.py", "docs/**/*.md", "src/?.txt", "[ab]*.rst"), exclude=("**/test_*",))
    assert selection.included("a.py") and selection.included("deep/down/a.py")
    assert selection.included("docs/x.md") and selection.included("docs/a/b/x.md")
    assert not selection.included("other/x.md")
    assert selection.included("src/a.txt") and not selection.included("src/ab.txt")
    assert selection.included("b1.rst") and not selection.included("c1.rst")
    assert selection.excluded("test_x.py") and selection.excluded("pkg/test_x.py")
    assert not Selection().included("a.py") and not Selection().excluded("a.py")


def test_include_and_exclude_choose_files_inside_directories(tmp_path):
    for name in ["a.py", "b.md", "c.txt", "d.jsonl", "e.bin", "pkg/f.py", "pkg/tests/test_g.py", "build/h.py",
                 ".hidden/i.py", "pkg/.j.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}" if name.endswith(".jsonl") else "x")

    def found(**selection):
        return [(f.path.relative_to(tmp_path).as_posix(), f.kind)
                for f in discover([tmp_path], Selection(**selection))]

    assert found() == [("c.txt", "text"), ("d.jsonl", "jsonl")]  # known kinds only
    assert found(include=("*.py",)) == [("a.py", "text"), ("build/h.py", "text"), ("pkg/f.py", "text"),
                                        ("pkg/tests/test_g.py", "text")]
    assert found(include=("*.py", "*.jsonl"), exclude=("build", "tests")) == [
        ("a.py", "text"), ("d.jsonl", "jsonl"), ("pkg/f.py", "text")]
    assert found(include=("pkg/*.py",)) == [("pkg/f.py", "text")]
    assert found(exclude=("*.txt",)) == [("d.jsonl", "jsonl")]
    with pytest.raises(ZayaError, match=r"no files in this directory match --include \*\.rs$"):
        discover([tmp_path], Selection(include=("*.rs",)))
    # a file named explicitly is read whatever the patterns; one of no known kind only if included
    assert discover([tmp_path / "e.bin"], Selection(include=("*.bin",)))[0].kind == "text"
    with pytest.raises(ZayaError, match=r"e\.bin: unsupported file type '\.bin' .*--include '\*\.bin' reads"):
        discover([tmp_path / "e.bin"])


def test_kinds_and_compression_by_name(tmp_path):
    names = {"a.jsonl.gz": ("jsonl", "gzip"), "b.TXT.ZST": ("text", "zstd"), "c.csv.zstd": ("csv", "zstd"),
             "d.tsv": ("tsv", None), "e.arrow": ("arrow", None), "f.json": ("json", None),
             "g.json": ("jsonl", None), "h.json.gz": ("json", "gzip")}
    for name in names:
        data = b'[{"text": "x"}]' if name in ("f.json", "h.json.gz") else b'{"text": "x"}\n'
        if name.endswith("arrow"):
            _arrow(tmp_path / name, ["x"], stream=True)
            continue
        payload = gzip.compress(data) if name.endswith(".gz") else _zstd(data) if "ZST" in name.upper() else data
        (tmp_path / name).write_bytes(payload)
    assert {f.path.name: (f.kind, f.compression) for f in discover([tmp_path])} == names
    (tmp_path / "bad.json").write_text("nope")
    with pytest.raises(ZayaError, match=r"bad\.json: not a JSON array or JSON lines \(starts with b'n'\)"):
        discover([tmp_path / "bad.json"])


def test_datasets_directories(tmp_path, saved_datasets):
    corpus = tmp_path / "corpus"
    shutil.copytree(saved_datasets / "small", corpus / "saved")
    shutil.copytree(saved_datasets / "small_dict", tmp_path / "dd")
    (corpus / "more.txt").write_text("more")
    # inside a directory a saved dataset is one input: its metadata files are never read as documents
    files = discover([corpus])
    assert [(f.path.relative_to(tmp_path).as_posix(), f.kind) for f in files] == [
        ("corpus/more.txt", "text"), ("corpus/saved/data-00000-of-00002.arrow", "arrow"),
        ("corpus/saved/data-00001-of-00002.arrow", "arrow")]
    assert [f.path.relative_to(tmp_path).as_posix() for f in discover([corpus], Selection(include=("*.txt",)))] == [
        "corpus/more.txt"]
    texts = [r.text for f in files[1:] for p in split_file(f, 0, ReadOptions(), 1 << 20)
             for r in read_piece(f, p, ReadOptions()).records]
    assert texts == ["one", "two", "three"]
    assert [f.path.parent.name for f in discover([tmp_path / "dd"])] == ["train"]
    assert [f.path.parent.name for f in discover([tmp_path / "dd"], split="validation")] == ["validation"]
    with pytest.raises(ZayaError, match=r"dd: no split 'test' \(splits: train, validation\)$"):
        discover([tmp_path / "dd"], split="test")
    (tmp_path / "dd" / "train" / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(ZayaError, match=r"data-00000-of-00001\.arrow: no such file \(listed in .*state\.json\)"):
        discover([tmp_path / "dd"])
    with pytest.raises(ZayaError, match=r"no column 'body' \(columns: text\)"):
        split_file(files[1], 0, ReadOptions(text_field="body"), 1 << 20)


def test_arrow_pieces_are_runs_of_record_batches(tmp_path):
    docs = [f"document {i} " * 20 for i in range(100)]
    for stream in (True, False):
        file = discover([_arrow(tmp_path / f"s{stream}.arrow", docs, stream=stream, batch_rows=10)])[0]
        pieces = split_file(file, 0, ReadOptions(), target_bytes=3000)
        assert len(pieces) > 3 and pieces[0].start == 0 and pieces[-1].stop == 10
        texts = [r.text for p in pieces for r in read_piece(file, p, ReadOptions()).records]
        assert texts == docs


def test_missing_zstandard_is_a_one_line_hint(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl.zst").write_bytes(_zstd(b'{"text": "x"}\n'))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ZayaError, match=r"a\.jsonl\.zst: reading zstd files needs the zstandard package "
                                        r"\(pip install 'zaya-stack\[corpora\]'\)$"):
        discover([tmp_path])


# ---- bad records and damaged files -------------------------------------------------------------------------


def test_bad_records_are_reported_by_file_and_line(tmp_path, documents, tokenizer_file):
    lines = [json.dumps({"text": d}) for d in documents[:30]]
    lines[4], lines[9] = "{broken", json.dumps({"body": "x"})
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    (tmp_path / "bad.csv").write_text('n,text\n1,"two\nlines"\nshort\n3,\n4,fine\n', encoding="utf-8")
    (tmp_path / "bad.json").write_text('[{"text": "a"}, 5, {"text": null}, {"text": "b"}]')
    _arrow(tmp_path / "bad.arrow", ["a", None, "b"], stream=True)
    names = ("bad.jsonl.gz", "bad.csv", "bad.json", "bad.arrow")
    report = _build(tmp_path, "d", [tmp_path / name for name in names], tokenizer=tokenizer_file, workers=2)
    gz, table, array, arrow = (tmp_path / name for name in names)
    assert report.problems[0].startswith(f"{gz}:5: not valid JSON")
    assert report.problems[1:] == [
        f"{gz}:10: no field 'text'",
        f"{table}:4: no field 'text' (the row has 1 of the header's 2 fields)",
        f"{array}: element 2: expected a JSON object, got int",
        f"{array}: element 3: field 'text' is NoneType, not a string",
        f"{arrow}: row 2: field 'text' is null",
    ]
    assert report.bad_records == 6
    # 27 of the 30 lines (two bad, one empty text), two CSV cells (one empty), two array elements, two rows
    assert open_dataset(report.path).manifest["corpus"]["documents"] == 27 + 2 + 2 + 2
    with pytest.raises(ZayaError, match=f"^{gz}:5: not valid JSON"):
        _build(tmp_path, "e", [gz], tokenizer=tokenizer_file, strict=True)
    assert not (tmp_path / "e").exists()


def _damaged(kind: str, path: Path, raw: bytes) -> Path:
    packed = gzip.compress(raw) if kind.startswith("gzip") else _zstd(raw, write_checksum=True)
    if kind.endswith("truncated"):
        packed = packed[:len(packed) // 2]
    elif kind.endswith("flipped"):
        packed = bytearray(packed)
        packed[-6] ^= 0x55  # in the trailer: the CRC / checksum catches it
        packed = bytes(packed)
    else:
        packed = b"\0garbage" * 20
    path.write_bytes(packed)
    return path


@pytest.mark.parametrize("kind", ["gzip truncated", "gzip flipped", "gzip garbage", "zstd truncated",
                                  "zstd flipped", "zstd garbage"])
@pytest.mark.parametrize("trained", [True, False])
def test_damaged_compressed_files_stop_the_build_in_one_line(tmp_path, documents, tokenizer_file, kind, trained,
                                                            monkeypatch):
    for name in ("_BLOCK", "_MAX_BLOCK"):  # small reads, so that lines are read before the damage is
        monkeypatch.setattr(compressed_module, name, 1024)
    raw = _jsonl(tmp_path / "plain.jsonl", documents * 40).read_bytes()  # several zstd blocks of 128 KB
    path = _damaged(kind, tmp_path / ("in.jsonl.gz" if kind.startswith("gzip") else "in.jsonl.zst"), raw)
    args = ["build", "-i", path, "-o", tmp_path / "out", "--workers", 2]
    args += ["--vocab-size", 300] if trained else ["--tokenizer", tokenizer_file]
    result = CliRunner().invoke(data, [str(a) for a in args])
    assert isinstance(result.exception, ZayaError), result.output
    message = str(result.exception)
    assert message.startswith(f"{path}: corrupt or truncated {kind.split()[0]} data") and "\n" not in message
    assert "(compressed byte " in message
    if kind.endswith("truncated"):
        assert " after line " in message
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["plain.jsonl", path.name])  # nothing written


def test_damaged_json_arrays(tmp_path):
    cases = {
        "open.json": ('[{"text": "a"}, {"text": "b"', "the JSON array is not closed (truncated?) after element 1"),
        "tail.json": ('[{"text": "a"}] junk', "data after the end of the array at byte 16"),
        "brace.json": ('[{"text": "a"}}, 1]', "unbalanced '}' at byte 14"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        file = discover([tmp_path / name])[0]
        with pytest.raises(ZayaError, match=f"{re.escape(name)}: {re.escape(message)}$"):
            read_piece(file, split_file(file, 0, ReadOptions(), 1 << 20)[0], ReadOptions())
    (tmp_path / "edge.json").write_text('  [ ]  ')
    file = discover([tmp_path / "edge.json"])[0]
    assert read_piece(file, split_file(file, 0, ReadOptions(), 1 << 20)[0], ReadOptions()).records == []
    (tmp_path / "comma.json").write_text('[{"text": "a"},]')
    file = discover([tmp_path / "comma.json"])[0]
    records = read_piece(file, split_file(file, 0, ReadOptions(), 1 << 20)[0], ReadOptions()).records
    assert [(r.text, r.problem) for r in records] == [("a", None), (None, "not valid JSON (an empty element)")]
    assert location(file, records[1].index, ReadOptions()) == f"{tmp_path / 'comma.json'}: element 2"


def test_csv_cells(tmp_path):
    big = "y" * 300_000  # beyond the csv module's default field limit
    path = tmp_path / "cells.csv"
    path.write_bytes("\ufefftext,n\n".encode() + f'"{big}",1\n'.encode() + b'caf\xe9,2\n' + b'"",3\n\n7,4\n')
    file = discover([path])[0]
    records = read_piece(file, split_file(file, 0, ReadOptions(), 1 << 20)[0], ReadOptions()).records
    assert [(r.text, r.invalid_utf8) for r in records] == [(big, False), ("caf\ufffd", True), ("7", False)]
    assert [location(file, r.index, ReadOptions()) for r in records] == [f"{path}:2", f"{path}:3", f"{path}:6"]
    with pytest.raises(ZayaError, match=r"cells\.csv: no column 'body' \(columns: text, n\)$"):
        split_file(file, 0, ReadOptions(text_field="body"), 1 << 20)


# ---- the command line --------------------------------------------------------------------------------------


def test_cli_include_exclude_split(tmp_path, saved_datasets):
    repo = tmp_path / "repo"
    for name, text in [("a.py", "print('a')\n"), ("docs/b.md", "# b\n"), ("tests/test_c.py", "assert 1\n")]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    runner = CliRunner()
    result = runner.invoke(data, ["build", "-i", str(repo), "-o", str(tmp_path / "code"), "--include", "*.py",
                                  "--include", "*.md", "--exclude", "tests", "--vocab-size", "300",
                                  "--no-progress"])
    assert result.exit_code == 0, result.output
    assert open_dataset(tmp_path / "code").num_documents == 2 and "corpus       2 files, " in result.output
    inspected = runner.invoke(data, ["inspect", str(tmp_path / "code")])
    assert inspected.exit_code == 0 and "corpus       2 files, " in inspected.output
    result = runner.invoke(data, ["build", "-i", str(saved_datasets / "small_dict"), "-o", str(tmp_path / "hf"),
                                  "--split", "validation", "--vocab-size", "300", "--val-fraction", "0"])
    assert result.exit_code == 0, result.output
    assert open_dataset(tmp_path / "hf").num_documents == 1
    result = runner.invoke(data, ["build", "-i", str(repo), "-o", str(tmp_path / "none"), "--include", "*.rs"])
    assert isinstance(result.exception, ZayaError) and "no files in this directory match --include *.rs" in str(
        result.exception)


# ---- memory ----------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from zaya.data import build, build_units, build_worker
    from zaya.data.corpus import ReadOptions, discover

    def megabytes(key):  # VmRSS: resident now; VmHWM: the peak so far
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith(key))

    corpus, out, tokenizer, log = sys.argv[1:5]
    job = build_worker.encode_job

    def measured_job(unit):  # runs in the worker: its resident memory before the job, and its peak after
        before = megabytes("VmRSS:")
        result = job(unit)
        with open(log, "a") as handle:
            handle.write(json.dumps({"before": before, "peak": megabytes("VmHWM:")}) + "\\n")
        return result

    build.encode_job = measured_job  # where the build looks it up
    before = megabytes("VmRSS:")
    # the tokenizer's sample as the BPE trainer reads it, taking the whole corpus (a sample larger than it)
    options = build.BuildOptions(inputs=(corpus,), out=Path(out), tokenizer_sample_bytes=1 << 40)
    files = discover(options.inputs)
    pieces = build_units.plan_pieces(files, ReadOptions(), 2)
    sampled = sum(len(text) for text in build._training_texts(options, files, pieces, ReadOptions()))
    sample_peak = megabytes("VmHWM:")
    report = build.build_dataset(build.BuildOptions(inputs=(corpus,), out=Path(out), tokenizer=Path(tokenizer),
                                                    workers=2))
    print(json.dumps({"before": before, "sample_peak": sample_peak, "peak": megabytes("VmHWM:"),
                      "sampled": sampled, "text_bytes": report.text_bytes}))
""")


def _fast_tokenizer(path: Path) -> Path:
    """A word-level tokenizer that cuts at newlines: the build does the same work around it as around a BPE
    (reading, buffering, encoding, spilling, writing) at a speed that lets a test tokenize a hundred MB on two
    cores. The encoder's own working set for a BPE is bounded separately (`_ENCODE_CHARS`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.CharDelimiterSplit("\n")
    tokenizer.save(str(path))
    return path


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from /proc")
def test_memory_is_bounded_by_the_workers_not_the_corpus(tmp_path):
    """Two compressed files of 64 MB of text each, each one streamed piece on its own worker: no process grows
    by even half a file, neither the workers tokenizing them nor the main process reading the whole corpus
    for the tokenizer's sample and writing the dataset."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 2)[:150] + "\n"
    for f in range(2):
        with open(corpus / f"part{f}.jsonl.zst", "wb") as raw, \
                zstandard.ZstdCompressor(level=1).stream_writer(raw) as sink:
            written, doc = 0, 0
            while written < 64 << 20:
                records = [json.dumps({"text": f"document {f}-{d}\n" + line * (5 + d % 20)}) + "\n"
                           for d in range(doc, doc + 1000)]
                block = "".join(records).encode()
                sink.write(block)
                written, doc = written + len(block), doc + 1000
    log = tmp_path / "jobs.jsonl"
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(corpus), str(tmp_path / "out"),
                             str(_fast_tokenizer(tmp_path / "tokenizer.json")), str(log)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    main = json.loads(result.stdout)
    jobs = [json.loads(line) for line in log.read_text().splitlines()]
    file_mb = main["text_bytes"] / 2 / 2**20
    assert len(jobs) == 2 and file_mb > 60 and main["sampled"] > 120 * 2**20
    sample_growth = main["sample_peak"] - main["before"]
    main_growth = main["peak"] - main["before"]
    worker_growth = max(job["peak"] - job["before"] for job in jobs)
    print(f"\n{file_mb:.0f} MB of text per file; peak growth: main {main_growth:.0f} MB (of which reading the "
          f"sample {sample_growth:.0f} MB), workers {worker_growth:.0f} MB")
    assert main_growth < file_mb / 2 and worker_growth < file_mb / 2
