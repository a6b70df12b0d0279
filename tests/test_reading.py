"""Reading files zaya did not write (`zaya.reading`) and their fields (`zaya.schema`): only regular files, within a
cap for their kind, nested within a bound, text in UTF-8, lines cut to a bound; every failure one `ZayaError`
naming the file and the key. None of these may block or hold a file whole."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import tracemalloc
from pathlib import Path

import pytest

from zaya import reading
from zaya.errors import ZayaError
from zaya.schema import Fields, is_a, shown


def _planted(tmp_path: Path) -> dict[str, Path]:
    """Things that are not regular files, where a file is expected."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    return {"a FIFO": fifo, "a character device": Path("/dev/zero"), "a directory": tmp_path,
            "a loop of symbolic links": loop, "file not found": tmp_path / "missing"}


@pytest.mark.parametrize("reader", [
    lambda p: reading.read_bytes(p, "config"), lambda p: reading.read_text(p, "template"),
    lambda p: reading.read_json(p), lambda p: reading.read_toml(p), lambda p: list(reading.read_lines(p)),
], ids=["bytes", "text", "json", "toml", "lines"])
def test_only_regular_files_are_read_and_nothing_blocks(tmp_path, reader):
    for words, path in _planted(tmp_path).items():
        with pytest.raises(ZayaError) as caught:
            reader(path)  # a FIFO without a writer would block forever in a plain open()
        assert str(caught.value).startswith(f"{path}: ") and words in str(caught.value), (words, caught.value)
    with pytest.raises(ZayaError, match="a character device, not a regular file"):
        reading.read_json("/dev/urandom")


def test_a_file_beyond_its_kinds_cap_is_refused_without_being_read_whole(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: a gigabyte of NULs, as /dev/zero copied to a file
    with _peak() as peak:
        with pytest.raises(ZayaError, match=r"big.json: larger than 16 MiB, the limit for a document file"):
            reading.read_json(big)
        with pytest.raises(ZayaError, match=r"larger than 4 KiB, the limit for checkpoints/latest"):
            reading.read_text(big, "pointer", "checkpoints/latest")
    assert peak() < 2 * reading.CAPS["document"]  # the cap and a byte, not the file
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * reading.CAPS["pointer"])
    assert reading.read_text(exact, "pointer") == "x" * 4096


@pytest.mark.parametrize(("content", "words"), [
    (b"\xff\xfe not utf-8", "not UTF-8 text (byte 0)"),
    (b"[" * 100 + b"]" * 100, "nested more than 64 deep"),
    (b"[" * 200_000, "not valid JSON (nested more than 64 deep)"),
    (b'{"a": 1,}', "not valid JSON (Expecting property name"),
    (b"1" * 5000, "not valid JSON (Exceeds the limit"),
])
def test_json_that_is_not_json_or_too_deep_is_one_line(tmp_path, content, words):
    path = tmp_path / "doc.json"
    path.write_bytes(content)
    with pytest.raises(ZayaError) as caught:
        reading.read_json(path)
    assert str(caught.value).startswith(f"{path}: ") and words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_toml_depth_and_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("a = " + "[" * 80 + "]" * 80)
    with pytest.raises(ZayaError, match="nested more than 64 deep"):
        reading.read_toml(path)
    path.write_text("a = 1\na = 2\n")
    with pytest.raises(ZayaError, match=r"c.toml: not valid TOML \(Cannot overwrite a value"):
        reading.read_toml(path)
    path.write_text("[t]\nx = 1\n")
    assert reading.read_toml(path) == {"t": {"x": 1}}


def test_json_object_and_links_not_followed(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[1]")
    with pytest.raises(ZayaError, match=r"a\.json: expected a JSON object, got a list"):
        reading.read_json_object(path)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert reading.read_json(link) == [1]
    with pytest.raises(ZayaError, match=r"link\.json: a symbolic link; a pointer file must be a regular file"):
        reading.read_bytes(link, "pointer", follow_links=False)


def test_lines_are_cut_at_their_bound_and_never_held_whole():
    stream = io.BytesIO(b"a" * 300_000 + b"\nshort\r\n" + b"b" * 70_000 + b"\n\nlast")
    lines = list(reading.bounded_lines(stream, max_line=1000, chunk=4096))
    assert [len(line) for line in lines] == [1000, 6, 1000, 0, 4]
    assert lines[1] == b"short\r" and lines[-1] == b"last"
    assert list(reading.bounded_lines(io.BytesIO(b""))) == []
    assert list(reading.bounded_lines(io.BytesIO(b"x\n"))) == [b"x"]
    # a gigabyte of NULs with no newline, read through a gzip stream: memory stays at the bound
    blob = io.BytesIO()
    with gzip.GzipFile(fileobj=blob, mode="wb") as handle:
        for _ in range(64):
            handle.write(bytes(1 << 20))
    blob.seek(0)
    with _peak() as peak:
        (only,) = reading.bounded_lines(gzip.GzipFile(fileobj=blob), max_line=1 << 16)
    assert len(only) == 1 << 16
    assert peak() < 1 << 20


@contextlib.contextmanager
def _peak():
    """The peak of Python's allocations within the block, in bytes (`peak()` once it has ended)."""
    tracemalloc.start()
    result: list[int] = []
    try:
        yield lambda: result[0]
    finally:
        result.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_fields_are_typed_with_the_file_and_the_key():
    doc = Fields({"step": 3, "name": "x", "ok": True, "lr": 0.5, "files": {"a": {"bytes": "9"}}, "big": 10**40,
                  "flag": 1, "nan": float("nan"), "ids": [1, 2, True]}, "run/zaya.json")
    assert (doc.int("step", lo=0), doc.str("name"), doc.bool("ok"), doc.float("lr", lo=0, hi=1)) == (3, "x", True, 0.5)
    assert doc.int("absent", None) is None and doc.float("lr") == 0.5
    cases = {
        lambda: doc.int("name"): "run/zaya.json: field 'name' must be an integer within +-2**63, got 'x'",
        lambda: doc.int("step", lo=4): "field 'step' must be an integer >= 4 (below 2**63), got 3",
        lambda: doc.int("big"): "field 'big' must be an integer within +-2**63, got an integer of about 41 digits",
        lambda: doc.int("ok"): "field 'ok' must be an integer within +-2**63, got True",
        lambda: doc.bool("flag"): "field 'flag' must be true or false, got 1",
        lambda: doc.float("nan"): "field 'nan' must be a finite number, got nan",
        lambda: doc.float("lr", hi=0.1): "field 'lr' must be a finite number <= 0.1, got 0.5",
        lambda: doc.obj("files").obj("a").int("bytes"): "field 'files.a.bytes' must be an integer within +-2**63, "
                                                        "got '9'",
        lambda: doc.str("missing"): "run/zaya.json: missing field 'missing'",
        lambda: doc.list("ids", of=int): "field 'ids.2' must be an integer, got True",
        lambda: doc.str("name", choices=("a", "b")): "field 'name' must be one of 'a', 'b', got 'x'",
        lambda: doc.obj("step"): "field 'step' must be an object, got 3",
        lambda: Fields([1], "f.json"): "f.json: expected a JSON object, got a list",
    }
    for call, message in cases.items():
        with pytest.raises(ZayaError) as caught:
            call()
        assert message in str(caught.value), (message, caught.value)
    assert not is_a(True, int) and is_a(True, bool) and not is_a(float("inf"), float) and not is_a(2**63, int)
    assert shown("x" * 500).endswith("...") and len(shown("x" * 500)) == 60
