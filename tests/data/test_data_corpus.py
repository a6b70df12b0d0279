import itertools
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from zaya.data.corpus import (
    InputFile,
    Piece,
    ReadOptions,
    discover,
    location,
    read_piece,
    split_file,
    stdlib_files,
)
from zaya.errors import ZayaError


def _all_records(file: InputFile, options: ReadOptions, target: int):
    """Every record of a file read piece by piece, with file-wide record numbers."""
    records, before = [], 0
    for piece in split_file(file, 0, options, target):
        contents = read_piece(file, piece, options)
        records += [(before + r.index, r.text, r.problem, r.invalid_utf8) for r in contents.records]
        before += contents.count
    return records


def test_directories_are_expanded_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "b" / "a.jsonl").write_text("{}")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / ".hidden.txt").write_text("h")
    (tmp_path / "notes.md").write_text("ignored inside a directory")
    files = discover([tmp_path, tmp_path / "a.txt"])  # the repeated file is read once
    assert [f.path.relative_to(tmp_path).as_posix() for f in files] == ["a.txt", "b/a.jsonl", "b/z.txt"]
    assert [f.kind for f in files] == ["text", "jsonl", "text"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: [], "no inputs given"),
        (lambda d: [d / "missing.txt"], "missing.txt: no such file or directory"),
        (lambda d: [(d / "x.md", "hi")], "unsupported file type '.md'"),
        (lambda d: [d / "empty"], "no .txt, .jsonl or .parquet files in this directory"),
    ],
)
def test_bad_inputs_are_named(tmp_path, make, message):
    (tmp_path / "empty").mkdir()
    inputs = []
    for item in make(tmp_path):
        if isinstance(item, tuple):
            item[0].write_text(item[1])
            item = item[0]
        inputs.append(item)
    with pytest.raises(ZayaError, match=message):
        discover(inputs)


def test_stdlib_is_the_interpreters_library_without_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert (root / "json" / "decoder.py") in files
    assert all(p.suffix == ".py" for p in files)
    skipped = {"test", "tests", "idle_test", "site-packages"}
    assert not any(skipped & set(p.relative_to(root).parts) for p in files)
    assert 2_000_000 < sum(p.stat().st_size for p in files) < 40_000_000
    assert [f.path for f in discover(["stdlib"])] == files


def test_jsonl_bad_lines_are_reported_with_line_numbers(tmp_path):
    lines = [
        json.dumps({"text": "first"}),
        "",
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"body": "no text"}),
        json.dumps({"text": 5}),
        json.dumps({"text": "last"}),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    file = discover([path])[0]
    options = ReadOptions()
    records = _all_records(file, options, target=1 << 20)
    assert [(i, t) for i, t, p, _ in records if p is None] == [(0, "first"), (6, "last")]
    problems = {location(file, i, options): p for i, _, p, _ in records if p is not None}
    assert list(problems) == [f"{path}:3", f"{path}:4", f"{path}:5", f"{path}:6"]
    assert problems[f"{path}:3"].startswith("not valid JSON")
    assert problems[f"{path}:4"] == "expected a JSON object, got list"
    assert problems[f"{path}:5"] == "no field 'text'"
    assert problems[f"{path}:6"] == "field 'text' is int, not a string"


def test_invalid_utf8_is_replaced_and_flagged(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 ok\n")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "x\xff"}\n{"text": "\\ud800 lone"}\n{"text": "fine"}\n')
    text, jsonl = sorted(discover([tmp_path]), key=lambda f: f.kind, reverse=True)
    [(_, content, _, invalid)] = _all_records(text, ReadOptions(), 1 << 20)
    assert content == "caf\ufffd ok\n" and invalid
    records = _all_records(jsonl, ReadOptions(), 1 << 20)
    assert [(r[1], r[3]) for r in records] == [("x\ufffd", True), ("\ufffd\ufffd\ufffd lone", True), ("fine", False)]


@pytest.mark.parametrize("separator", [None, "<|end|>"])
def test_pieces_cover_a_file_at_record_boundaries(tmp_path, separator):
    docs = [f"document {i} " + "word " * (i % 13) for i in range(400)]
    if separator:
        path = tmp_path / "big.txt"
        path.write_text(separator.join(docs) + separator)
    else:
        path = tmp_path / "big.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    file = discover([path])[0]
    options = ReadOptions(doc_separator=separator)
    pieces = split_file(file, 0, options, target_bytes=1000)
    assert len(pieces) > 10
    assert pieces[0].start == 0 and pieces[-1].stop == file.size
    assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))
    records = _all_records(file, options, target=1000)
    assert [r[1] for r in records] == docs
    assert [r[0] for r in records] == list(range(400))
    whole = _all_records(file, options, target=1 << 30)
    assert whole == records


def test_a_text_file_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("line one\nline two\n")
    file = discover([path])[0]
    assert split_file(file, 0, ReadOptions(), target_bytes=4) == [Piece(0, 0, file.size, file.size)]
    assert [r[1] for r in _all_records(file, ReadOptions(), 4)] == ["line one\nline two\n"]


def test_unreadable_files(tmp_path):
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(ZayaError, match=r"gone.txt: cannot read \(no such file or directory\)"):
        discover([tmp_path])


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    table = pa.table({"text": ["one", None, "three", "", "five"], "n": [1, 2, 3, 4, 5]})
    pq.write_table(table, path, row_group_size=2)
    file = discover([path])[0]
    assert len(split_file(file, 0, ReadOptions(), 1 << 20)) == 3
    records = _all_records(file, ReadOptions(), 1 << 20)
    assert [(r[0], r[1]) for r in records if r[2] is None] == [(0, "one"), (2, "three"), (4, "five")]
    assert [(location(file, r[0], ReadOptions()), r[2]) for r in records if r[2]] == [
        (f"{path}: row 2", "field 'text' is null")
    ]
    with pytest.raises(ZayaError, match=r"no column 'body' \(columns: text, n\)"):
        split_file(file, 0, ReadOptions(text_field="body"), 1 << 20)
    with pytest.raises(ZayaError, match="column 'n' holds int64, not text"):
        split_file(file, 0, ReadOptions(text_field="n"), 1 << 20)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ZayaError, match=r"broken\.parquet: not a readable parquet file"):
        split_file(discover([tmp_path / "broken.parquet"])[0], 0, ReadOptions(), 1 << 20)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ZayaError, match=r"data.parquet: reading .parquet files needs pyarrow \(pip install pyarrow\)"):
        discover([path])
