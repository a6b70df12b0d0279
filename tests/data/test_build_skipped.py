"""What a build did not read is said: the files of an input directory it passed over (by reason and kind, with the
--include that reads them), the most common reason of its bad records (with the flag that fixes it), and a val
split that came out empty or too small to evaluate on."""

import json
import os
import shlex

import pytest
from tests.runs import make_chats

from zaya.data import skipped as skipped_module
from zaya.data.corpus import Selection, discover
from zaya.data.shards import BUILD_FILE
from zaya.data.skipped import MAX_REASONS, OTHER_REASON, SkippedFiles, count_reason, reason_of


def _build(cli, *args):
    return cli("data", "build", *map(str, args), "--vocab-size", "300", "--workers", "1", "--no-progress")


def _warnings(err: str) -> list[str]:
    return [line.removeprefix("zaya: warning: ") for line in err.splitlines() if line.startswith("zaya: warning: ")]


@pytest.fixture
def source_tree(tmp_path, synthetic_documents):
    """A source tree of which a build reads one file unless told more: code, a README, an image, a hidden
    directory, a FIFO and a link to a directory."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "img").mkdir()
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    for i, doc in enumerate(synthetic_documents(4, seed=1)):
        (root / "pkg" / f"m{i}.py").write_text(doc)
    (root / "main.c").write_text("int main(void) { return 0; }\n")
    (root / "README.md").write_text("# a project\n")
    (root / "notes.txt").write_text(synthetic_documents(1, seed=2)[0])
    (root / "img" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    os.mkfifo(root / "pipe")
    (root / "linked").symlink_to(root / "pkg", target_is_directory=True)
    return root


def test_a_directory_build_says_what_it_skipped_and_the_include_that_reads_it(cli, tmp_path, source_tree):
    code, _, err = _build(cli, "-i", source_tree, "-o", tmp_path / "d")
    assert code == 0, err
    first = err.splitlines()[0]  # said as soon as the inputs are known, before the tokenizer is trained
    assert first == (
        "zaya: warning: skipped 8 of 9 files in the input directories and 2 directories: "
        "6 of unread kinds (.py 4, .md 1, .c 1; e.g. pkg/m0.py, README.md, main.c), "
        "1 binary (.png 1; e.g. img/logo.png), 1 not a regular file (e.g. pipe), "
        "1 link to a directory (not followed) (e.g. linked/), 1 hidden (e.g. .git/); "
        "read them as text with --include '*.py' --include '*.md' --include '*.c' "
        "(and --include '*.txt' to keep the .txt files)")
    info = json.loads((tmp_path / "d" / BUILD_FILE).read_text())
    assert info["warnings"][0] == first.removeprefix("zaya: warning: ")
    assert info["skipped_files"]["read"] == 1
    assert info["skipped_files"]["skipped"]["unread"]["kinds"] == {".py": 4, ".md": 1, ".c": 1}
    assert info["skipped_files"]["skipped"]["binary"] == {"files": 1, "directories": 0, "kinds": {".png": 1},
                                                          "examples": ["img/logo.png"]}

    # the hint is a command line that works: every text file is read, nothing of an unread kind is left
    hint = first.partition("read them as text with ")[2].replace(" (and ", " ").removesuffix(" to keep the .txt files)")
    code, _, err = _build(cli, "-i", source_tree, "-o", tmp_path / "e", *shlex.split(hint))
    assert code == 0, err
    info = json.loads((tmp_path / "e" / BUILD_FILE).read_text())
    assert info["files"] == 7 and "unread" not in info["skipped_files"]["skipped"]
    assert "not matching --include (.png 1" not in err and "1 binary (.png 1" in err  # an image is never suggested


def test_what_the_user_asked_to_skip_is_recorded_but_not_warned_of(cli, tmp_path, synthetic_documents):
    root = tmp_path / "corpus"
    (root / ".cache").mkdir(parents=True)
    (root / ".cache" / "x.txt").write_text("cached\n")
    (root / "tests").mkdir()
    (root / "tests" / "t.txt").write_text("a test\n")
    (root / "a.txt").write_text(synthetic_documents(1)[0])
    code, _, err = _build(cli, "-i", root, "-o", tmp_path / "d", "--exclude", "tests")
    assert code == 0 and "skipped" not in err
    skipped = json.loads((tmp_path / "d" / BUILD_FILE).read_text())["skipped_files"]["skipped"]
    assert skipped["hidden"]["examples"] == [".cache/"] and skipped["excluded"]["examples"] == ["tests/"]


def test_a_directory_of_nothing_readable_names_its_kinds_and_the_include(cli, tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(5):
        (root / f"m{i}.py").write_text(f"x = {i}\n")
    (root / "blob").write_bytes(b"\x00\x01\x02")
    code, _, err = _build(cli, "-i", root, "-o", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1
    assert err.rstrip().endswith("; it has .py 5, no extension 1; read them as text with --include '*.py'")


def test_the_skipped_files_are_bounded_and_few_are_read(tmp_path, monkeypatch):
    root = tmp_path / "many"
    root.mkdir()
    for kind in range(100):
        for i in range(3):
            (root / f"f{i}.k{kind:03d}").write_text("text\n")
    for i in range(50):
        (root / f"b{i:02d}.dat").write_bytes(b"\x00" * 64)
    (root / "a.txt").write_text("a document\n")
    sniffed = []
    binary = skipped_module._binary
    monkeypatch.setattr(skipped_module, "_binary", lambda path: sniffed.append(path) or binary(path))
    skipped = SkippedFiles()
    assert len(discover([root], Selection(), skipped=skipped)) == 1
    line = skipped.text()
    assert line.startswith("skipped 350 of 351 files in the input directories: 300 of unread kinds (.k000 3, "
                           ".k001 3, .k002 3, .k003 3, 288 of other kinds; e.g. f0.k000, f0.k001, f0.k002), 50 binary "
                           "(.dat 50; e.g. b00.dat)")
    assert len(line) < 500 and len(sniffed) <= 3 * 65  # a few files of each kind, whatever their number
    record = skipped.to_dict()["skipped"]["unread"]
    # 64 kinds counted apart, one of them the binary .dat
    assert record["files"] == 300 and len(record["kinds"]) == 64 and record["kinds"]["other kinds"] == 300 - 63 * 3


def test_every_bad_record_lacking_the_field_names_the_flag(cli, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in make_chats(2)))
    code, _, err = _build(cli, "-i", chats, "-o", tmp_path / "d")
    assert code == 2 and err == (
        f"zaya: error: no documents in the inputs (1 files, 0 bytes of text, 2 bad records: 2 have no field 'text' "
        f"(their fields: messages), the first at {chats}:1; use --format chat for chats, or --text-field NAME)\n")

    documents = tmp_path / "docs.jsonl"
    documents.write_text("".join(json.dumps({"id": i, "body": f"document {i}"}) + "\n" for i in range(3)))
    code, _, err = _build(cli, "-i", documents, "-o", tmp_path / "e")
    assert code == 2 and err.rstrip().endswith("3 have no field 'text' (their fields: id, body), the first at "
                                               f"{documents}:1; use --text-field body)")


def test_a_chat_build_of_documents_says_to_build_them_as_text(cli, tmp_path):
    documents = tmp_path / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    code, _, err = _build(cli, "--format", "chat", "-i", documents, "-o", tmp_path / "d")
    assert code == 2 and err.rstrip().endswith(
        "3 have no field 'messages' (their fields: text), the first at "
        f"{documents}:1; these are documents, not chats: build them without --format chat)")


def test_skipped_records_are_summed_up_by_reason_with_the_fix(cli, tmp_path, synthetic_documents):
    source = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"text": d}) for d in synthetic_documents(20)]
    lines += [json.dumps({"body": "x", "id": 1}), json.dumps({"body": "y"}), json.dumps({"body": "z", "id": 2}),
              "not json {", json.dumps({"text": 3})]
    source.write_text("\n".join(lines) + "\n")
    code, _, err = _build(cli, "-i", source, "-o", tmp_path / "d")
    assert code == 0
    summary = [w for w in _warnings(err) if w.startswith("skipped ")]
    assert summary == ["skipped 5 bad records: 3 have no field 'text' (their fields: body, id), 1 not valid JSON, "
                       "1 whose field 'text' is int, not a string; use --text-field body; the first 5 are listed above"]
    info = json.loads((tmp_path / "d" / BUILD_FILE).read_text())
    assert info["bad_record_reasons"] == {"no field 'text' (their fields: body, id)": 2,
                                          "no field 'text' (their fields: body)": 1, "not valid JSON": 1,
                                          "field 'text' is int, not a string": 1}
    assert summary[0] in info["warnings"]


def test_reasons_leave_out_what_differs_by_record_and_are_bounded():
    assert reason_of("not valid JSON (Expecting value: line 1 column 1 (char 0))") == "not valid JSON"
    assert reason_of("message 12 has role 'tool', not one of system, user, assistant") == (
        "a message has role 'tool', not one of system, user, assistant")
    assert reason_of("no field 'text'", ("a", "b")) == "no field 'text' (their fields: a, b)"
    reasons: dict[str, int] = {}
    for i in range(MAX_REASONS + 10):
        count_reason(reasons, f"reason {i}")
    assert len(reasons) == MAX_REASONS + 1 and reasons[OTHER_REASON] == 10


def test_an_empty_val_split_is_said_at_build_time(cli, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in make_chats(40, seed=3)))
    code, stdout, err = _build(cli, "--format", "chat", "-i", chats, "-o", tmp_path / "d", "--val-fraction", "0.01")
    assert code == 0 and "val          0 tokens" in stdout
    said = [w for w in _warnings(err) if "val split" in w]
    assert said == ["the val split is empty: --val-fraction 0.01 held out none of the 40 documents (the split "
                    "goes by a hash of each document's text, so a small set may get none) and a run that evaluates "
                    "on it stops at its first evaluation; build with --val-fraction 0.1 or more, or set "
                    "train.eval_every = 0"]
    assert said[0] in json.loads((tmp_path / "d" / BUILD_FILE).read_text())["warnings"]

    code, stdout, err = _build(cli, "--format", "chat", "-i", chats, "-o", tmp_path / "e", "--val-fraction", "0.1")
    assert code == 0 and "val          0 tokens" not in stdout
    assert next(w for w in _warnings(err) if "val split" in w).startswith("the val split holds only ")


def test_a_val_split_that_fills_an_evaluation_batch_is_not_warned_of(cli, tmp_path, synthetic_documents):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(200, words=120)))
    code, _, err = _build(cli, "-i", corpus, "-o", tmp_path / "d", "--val-fraction", "0.2")
    assert code == 0 and _warnings(err) == []
