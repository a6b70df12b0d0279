import json

import pytest
from click.testing import CliRunner

from zaya.data.dataset_reader import open_dataset
from zaya.data_cli import data
from zaya.errors import ZayaError


def run(*args) -> tuple[int, str, str]:
    """Run `zaya data ...` the way the top-level command does: a ZayaError is one line and exit code 2."""
    result = CliRunner().invoke(data, [str(a) for a in args])
    if isinstance(result.exception, ZayaError):
        return 2, result.stdout, f"zaya: error: {result.exception}\n"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def corpus(tmp_path, synthetic_documents, write_corpus):
    return write_corpus(tmp_path / "corpus", synthetic_documents(60, seed=4))


def test_build_then_inspect(tmp_path, corpus):
    out = tmp_path / "data"
    code, stdout, _ = run("build", "--input", corpus / "doc000.txt", corpus / "rest.jsonl", "--out", out,
                          "--vocab-size", 300, "--workers", 1, "--no-progress")
    assert code == 0
    dataset = open_dataset(out)
    assert f"fingerprint  {dataset.fingerprint}" in stdout
    assert dataset.manifest["corpus"]["documents"] == 31 and "corpus       2 files, " in stdout
    # how the documents were packaged is not part of the dataset's identity: build.json has the file count
    assert "files" not in dataset.manifest["corpus"]
    assert json.loads((out / "build.json").read_text())["files"] == 2

    code, stdout, _ = run("inspect", out, "--json", "--verify", "--no-progress")
    summary = json.loads(stdout)
    assert code == 0 and summary["fingerprint"] == dataset.fingerprint
    assert summary["verified_files"] == len(dataset.files()) and summary["tokenizer"]["vocab_size"] == 300
    assert summary["num_tokens"] == dataset.num_tokens

    code, stdout, _ = run("inspect", out, "--verify", "--no-progress")
    assert code == 0 and "every checksum matches" in stdout and "train " in stdout


def test_inspect_reports_a_checksum_mismatch_in_one_line(tmp_path, corpus):
    out = tmp_path / "data"
    assert run("build", "-i", corpus, "-o", out, "--vocab-size", 300, "--workers", 1)[0] == 0
    shard = out / "train.00000.bin"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[0] ^= 1
    shard.write_bytes(bytes(data_bytes))
    assert run("inspect", out)[0] == 0  # without --verify only sizes are checked
    code, _, stderr = run("inspect", out, "--verify")
    assert code == 2
    assert stderr.startswith(f"zaya: error: {shard}: checksum mismatch") and stderr.count("\n") == 1


def test_bad_records_warn_with_file_and_line(tmp_path, corpus):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n{"other": 1}\n')
    code, _, stderr = run("build", "-i", corpus, bad, "-o", tmp_path / "d", "--vocab-size", 300, "--workers", 1)
    assert code == 0
    assert f"zaya: warning: {bad}:2: not valid JSON" in stderr
    assert f"zaya: warning: {bad}:3: no field 'text'" in stderr
    assert "skipped 2 bad records" in stderr

    code, _, stderr = run("build", "-i", corpus, bad, "-o", tmp_path / "e", "--vocab-size", 300, "--strict")
    assert code == 2 and stderr.startswith(f"zaya: error: {bad}:2: not valid JSON") and stderr.count("\n") == 1
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "--out", "x"], "no inputs given"),
        (["build", "-i", "nowhere.txt", "--out", "x"], "nowhere.txt: no such file or directory"),
        (["build", "-i", "stdlib", "--out", "x", "--tokenizer", "t.json", "--vocab-size", "9"],
         "give --tokenizer or --vocab-size, not both"),
        (["build", "-i", "stdlib", "--out", "x", "--vocab-size", "100"], "--vocab-size must be between 259"),
        (["build", "-i", "stdlib", "--out", "x", "--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
        (["inspect", "nowhere"], "nowhere: no such dataset directory"),
    ],
)
def test_user_errors_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run(*args)
    assert code == 2
    assert stderr.startswith("zaya: error: ") and message in stderr and stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
