"""`zaya data` against careless or hostile inputs: it replaces only a dataset it can prove it wrote, cleans up
after SIGTERM, reads every file within a cap (no FIFO hangs it, no device or decompression bomb fills memory),
bounds every record it holds, and says what is wrong in one line (wrong types, names too long, link loops)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from zaya.data import compressed as compressed_module
from zaya.data import records as records_module
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.corpus import ReadOptions, discover, location, read_piece, split_file
from zaya.data.dataset_reader import open_dataset
from zaya.data.loader import TokenLoader
from zaya.errors import ZayaError
from zaya.locking import lock_path
from zaya.owned import MARKER, Staging


def _one_line(cli, args, match: str) -> str:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), (args, err)
    assert match in lines[0], (match, lines[0])
    return lines[0]


def _tree(root: Path) -> dict:
    """Every path under `root` with its kind and, for files, its bytes."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else p.is_symlink())
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def text(tmp_path) -> Path:
    source = tmp_path / "in.txt"
    source.write_text("one two three four five six seven eight nine ten\n" * 40)
    return source


def _build_args(source, out, tokenizer, *more):
    return ["data", "build", "--input", source, "--out", out, "--tokenizer", tokenizer, "--workers", "1",
            "--no-progress", *more]


# ---- ownership: --overwrite replaces only a dataset ----------------------------------------------------------


def _web_app(out: Path) -> None:
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my app", "icons": []}')
    (out / "index.html").write_text("<html></html>")


def _listed_file_missing(out: Path, dataset: Path) -> None:
    shutil.copytree(dataset, out)
    (out / "train.00000.bin").unlink()


def _extra_file(out: Path, dataset: Path) -> None:
    shutil.copytree(dataset, out)
    (out / "notes.txt").write_text("mine")


def _a_link(out: Path, dataset: Path) -> None:
    shutil.copytree(dataset, out.parent / "real")
    out.symlink_to(out.parent / "real")


NOT_OURS = {
    "a web app's manifest.json": (lambda out, dataset: _web_app(out), "is not a dataset; refusing to replace it"),
    "a manifest without its shards": (_listed_file_missing, "train.00000.bin, which its manifest lists"),
    "a dataset with a user's file": (_extra_file, "holds 'notes.txt', which is not part of its dataset"),
    "a link to a dataset": (_a_link, "is a symbolic link; refusing to replace it"),
}


@pytest.mark.parametrize("case", NOT_OURS)
def test_overwrite_refuses_what_is_not_a_dataset_zaya_wrote(cli, tmp_path, text, tokenizer_file, dataset, case):
    make, match = NOT_OURS[case]
    out = tmp_path / "out"
    make(out, dataset)
    before = _tree(tmp_path)
    _one_line(cli, _build_args(text, out, tokenizer_file, "--overwrite"), match)
    assert _tree(tmp_path) == before


def test_overwrite_replaces_a_dataset_or_an_empty_directory_and_only_our_own_staging(cli, tmp_path, text,
                                                                                     tokenizer_file, dataset):
    out = tmp_path / "out"
    out.mkdir()
    unrelated = [tmp_path / ".out.partial-0123456789ab", tmp_path / ".out.zaya-1-0123456789ab"]  # no marker
    for directory in unrelated:
        directory.mkdir()
        (directory / "keep.txt").write_text("not zaya's")
    killed = Staging(out, "zaya data build").__enter__()  # what a build killed with SIGKILL leaves
    assert (killed.root / MARKER).is_file()
    assert cli(*_build_args(text, out, tokenizer_file, "--overwrite"))[0] == 0  # an empty directory
    assert open_dataset(out).num_documents > 0 and not killed.root.exists()
    assert all((d / "keep.txt").read_text() == "not zaya's" for d in unrelated)
    shutil.rmtree(out)
    shutil.copytree(dataset, out)
    assert cli(*_build_args(text, out, tokenizer_file, "--overwrite"))[0] == 0  # a dataset
    assert open_dataset(out).fingerprint != open_dataset(dataset).fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.txt", "out", *(d.name for d in unrelated)])


# ---- interruptions ------------------------------------------------------------------------------------------

_SLOW_BUILD = """
import faulthandler, os, signal, sys, time
import zaya.data.build as build, zaya.data.build_worker as worker

faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it not end
# Ctrl-C as it reaches a zaya started at a terminal: a test runner started in the background (`make test &`)
# hands its children SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

def encode_job(job):  # a worker that announces itself and then takes its time
    with open(sys.argv[1], "a") as ready:
        ready.write(f"{os.getpid()}\\n")
    time.sleep(60)

build.encode_job = worker.encode_job = encode_job
from zaya.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_removes_the_builds_staging_and_lock_and_ends_its_workers(tmp_path, tokenizer_file):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(2):  # two files of more than a unit of work each: two jobs, in a pool of two workers
        (inputs / f"{i}.txt").write_text(f"document {i} of many words\n" * 12_000)
    out, ready, logs = tmp_path / "out", tmp_path / "ready", tmp_path.parent / f"{tmp_path.name}.stderr"
    before = _tree(tmp_path)
    with open(logs, "wb") as stderr:  # a file, not a pipe: the wait is for the build, not for its pipe's holders
        process = subprocess.Popen(
            [sys.executable, "-c", _SLOW_BUILD, str(ready), *map(str, _build_args(inputs, out, tokenizer_file)[:-3]),
             "--workers", "2", "--no-progress"], stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(ready.read_text().split() if ready.exists() else []) < 2:
            assert process.poll() is None and time.monotonic() < deadline, logs.read_text()
            time.sleep(0.02)
        workers = [int(pid) for pid in ready.read_text().split()]
        assert lock_path(out).exists() and any(p.name.startswith(".out.") and p.is_dir() for p in tmp_path.iterdir())
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the build and its workers
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            pytest.fail(f"the build did not end within 30 s of Ctrl-C; its threads:\n{logs.read_text()}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    err = logs.read_text()
    logs.unlink()
    assert process.returncode == 130 and err.split() == ["zaya:", "aborted"], err  # no worker's traceback
    ready.unlink()
    assert _tree(tmp_path) == before  # no staging, no lock, no output: nothing but what was there
    for pid in workers:  # the pool ended its workers, which leave Ctrl-C to it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_during_tokenizer_training_is_not_held_off_until_it_ends(tmp_path, text, monkeypatch):
    from zaya.data import build as build_module
    from zaya.owned import Terminated, interrupt_on_sigterm

    fed = []

    def texts(*args):
        for i in range(20_000):
            if i == 100:
                os.kill(os.getpid(), signal.SIGTERM)  # while the trainer runs, reading from threads of its own
            if i >= 100:
                time.sleep(0.001)  # the rest would take 20 s to read
            fed.append(i)
            yield f"text number {i} of the sample"

    monkeypatch.setattr(build_module, "_training_texts", texts)
    previous = signal.getsignal(signal.SIGTERM)
    interrupt_on_sigterm()  # as the command line does
    before = _tree(tmp_path)
    try:
        with pytest.raises(Terminated):
            build_dataset(BuildOptions(inputs=(str(text),), out=tmp_path / "out", vocab_size=300, workers=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(fed) < 2_000  # the training stopped within moments of the signal
    assert _tree(tmp_path) == before


# ---- bounded reads: FIFOs, devices --------------------------------------------------------------------------


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _device(path: Path, device: str = "/dev/zero") -> Path:
    path.symlink_to(device)
    return path


@pytest.mark.parametrize("make", [_fifo, _device, lambda p: _device(p, "/dev/urandom")], ids=["fifo", "zero",
                                                                                                  "urandom"])
def test_no_file_the_data_commands_read_can_hang_or_fill_memory(cli, tmp_path, text, tokenizer_file, dataset, make):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    (data / "manifest.json").unlink()
    make(data / "manifest.json")
    _one_line(cli, ["data", "inspect", data], "manifest.json: ")
    _one_line(cli, _build_args(text, tmp_path / "o", make(tmp_path / "tokenizer.json")), "tokenizer.json: ")
    _one_line(cli, ["data", "build", "--format", "chat", "--input", chats, "--chat-template",
                    make(tmp_path / "t.jinja"), "--out", tmp_path / "o", "--no-progress"], "t.jinja: ")
    _one_line(cli, _build_args(make(tmp_path / "named.txt"), tmp_path / "o", tokenizer_file), "not a regular file")
    shard = tmp_path / "shard"  # a file the manifest lists, replaced
    shutil.copytree(dataset, shard)
    (shard / "train.00000.bin").unlink()
    make(shard / "train.00000.bin")
    _one_line(cli, ["data", "inspect", shard, "--verify"], "train.00000.bin: ")
    info = tmp_path / "info"  # build.json says only how the dataset was built: inspect does without it
    shutil.copytree(dataset, info)
    (info / "build.json").unlink()
    make(info / "build.json")
    assert cli("data", "inspect", info)[0] == 0
    assert not (tmp_path / "o").exists()


def test_a_saved_datasets_state_file_is_read_within_bounds(tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}) + " " * (17 << 20))
    with pytest.raises(ZayaError, match=r"state.json: larger than 16 MiB, the limit for a datasets metadata file"):
        discover([saved])
    for state, match in [({"_data_files": "data.arrow"}, "field '_data_files' must be a list"),
                         ({"_data_files": [{"filename": 7}]}, "field '_data_files.0.filename' must be a string"),
                         ({"_data_files": [{"filename": "a\0b"}]}, "must be a plain file name")]:
        (saved / "state.json").write_text(json.dumps(state))
        with pytest.raises(ZayaError, match=match):
            discover([saved])
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": [1, 2]}))
    with pytest.raises(ZayaError, match=r"field 'splits.0' must be a string"):
        discover([saved])


# ---- decompression and records over their bounds --------------------------------------------------------


def _nul_bomb(path: Path) -> Path:
    """200 MB of NULs in a gzip of 200 KB (members of 1 MiB, as parallel compressors write them), or a zstd file of
    a few KB (frames of 1 MiB)."""
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(b"\0" * (1 << 20), compresslevel=9) * 200)
    else:
        zstandard = pytest.importorskip("zstandard")
        path.write_bytes(zstandard.ZstdCompressor().compress(b"\0" * (1 << 20)) * 200)
    return path


@pytest.mark.parametrize(("name", "problem"), [
    ("bomb.txt.gz", "a document of more than 64 MiB (the limit for one record)"),  # read up to the bound, no further
    ("bomb.jsonl.zst", "inflates more than 2000 times"),  # refused once 64 MiB have come out of a few KB
])
def test_a_decompression_bomb_is_one_line_and_never_held(tmp_path, name, problem):
    (file,) = discover([_nul_bomb(tmp_path / name)])
    assert file.size < 250_000
    tracemalloc.start()
    try:
        try:
            records = read_piece(file, split_file(file, 0, ReadOptions(), 1 << 20)[0], ReadOptions()).records
            found = [r.problem for r in records]
        except ZayaError as error:
            found = [str(error)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(found) == 1 and problem in found[0] and "\n" not in found[0], found
    assert peak < 100 << 20  # held: a block, one record at most (64 MiB); the file inflates to 200 MB


@pytest.fixture
def small_limits(monkeypatch):
    """A 64 KiB bound for one record (8 KiB for a chat), so that records over it are cheap to make."""
    monkeypatch.setattr(records_module, "MAX_RECORD_BYTES", 1 << 16)
    monkeypatch.setattr(records_module, "MAX_CHAT_BYTES", 1 << 13)
    monkeypatch.setattr(records_module, "_BLOCK", 1 << 12)  # and small reads, so that records straddle them
    monkeypatch.setattr(compressed_module, "_RATIO_AFTER", 1 << 30)


BIG = "x" * 100_000


def _records(path: Path, options: ReadOptions | None = None) -> list:
    options = options or ReadOptions()
    (file,) = discover([path])
    records = []
    for piece in split_file(file, 0, options, 1 << 20):
        records += [(location(file, r.index, options), r.text, r.problem)
                    for r in read_piece(file, piece, options).records]
    return records


def _arrow(path: Path, column: str, values) -> Path:
    pa = pytest.importorskip("pyarrow")
    table = pa.table({column: values})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return path


def _parquet(path: Path, column: str, values) -> Path:
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet").write_table(pa.table({column: values}), path)
    return path


LINES = {  # a file whose second record is over the bound: (name, writer, where the bad record is, what it is)
    "jsonl": ("a.jsonl", lambda p: p.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", BIG, "c"])),
              ":2", "a line of more than 64 KiB"),
    "jsonl.gz": ("a.jsonl.gz", lambda p: p.write_bytes(gzip.compress(
        "".join(json.dumps({"text": t}) + "\n" for t in ["a", BIG, "c"]).encode())), ":2", "a line of more than"),
    "txt split": ("a.txt", lambda p: p.write_text(f"a\n---\n{BIG}\n---\nc"), ": document 2", "a document of more"),
    "txt.gz whole": ("b.txt.gz", lambda p: p.write_bytes(gzip.compress(BIG.encode())), "b.txt.gz",
                     "a document of more than 64 KiB"),
    "json array": ("a.json", lambda p: p.write_text(json.dumps([{"text": t} for t in ["a", BIG, "c"]])),
                   ": element 2", "an element of more than 64 KiB"),
    "arrow": ("a.arrow", lambda p: _arrow(p, "text", ["a", BIG, "c"]), ": row 2", "a cell of more than 64 KiB"),
    "parquet": ("a.parquet", lambda p: _parquet(p, "text", ["a", BIG, "c"]), ": row 2", "a cell of more than"),
}


@pytest.mark.parametrize("kind", LINES)
def test_a_record_over_the_bound_is_a_bad_record_skipped_unread(tmp_path, small_limits, kind):
    name, write, where, problem = LINES[kind]
    write(tmp_path / name)
    options = ReadOptions(doc_separator="\n---\n" if kind == "txt split" else None)
    records = _records(tmp_path / name, options)
    bad = [r for r in records if r[2] is not None]
    assert len(bad) == 1 and bad[0][0].endswith(where) and bad[0][2].startswith(problem), records
    assert [r[1].strip() for r in records if r[1] is not None] == (["a", "c"] if "whole" not in kind else [])


def test_a_csv_row_over_the_bound_stops_at_its_line(tmp_path, small_limits):
    (tmp_path / "a.csv").write_text(f'text\na\n"{BIG}"\nc\n')
    with pytest.raises(ZayaError, match=r"a.csv:3: a row of more than 65,536 characters"):
        _records(tmp_path / "a.csv")


def test_a_csv_row_of_a_million_cells_stops_at_its_line(tmp_path):
    (tmp_path / "b.csv").write_text("text\n" + "ab," * 1_100_000 + "\n")  # 3 MB that would take 80 MB as cells
    with pytest.raises(ZayaError, match=r"b.csv:2: a row of more than 1,048,576 fields"):
        _records(tmp_path / "b.csv")


def test_a_build_of_nothing_but_bad_records_names_the_first(cli, tmp_path, tokenizer_file, small_limits):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": BIG}) + "\n")
    _one_line(cli, _build_args(tmp_path / "a.jsonl", tmp_path / "o", tokenizer_file),
              f"1 bad records: 1 is a line of more than 64 KiB, the first at {tmp_path / 'a.jsonl'}:1")


def test_a_build_json_that_is_not_one_does_not_stop_inspect(cli, tmp_path, dataset):
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    for content in ("[" * 100_000, '{"files": "many"}', " " * (17 << 20)):
        (copy / "build.json").write_text(content)
        code, out, err = cli("data", "inspect", copy)
        assert code == 0 and "corpus       " in out and "files" not in out.split("corpus", 1)[1], err


# ---- flags, names, links, types -----------------------------------------------------------------------------


def test_split_without_a_saved_datasetdict_is_one_line(cli, tmp_path, text, tokenizer_file):
    _one_line(cli, _build_args(text, tmp_path / "o", tokenizer_file, "--split", "test"),
              "--split test: none of the inputs is a saved DatasetDict")


def test_names_too_long_and_link_loops_are_one_line(cli, tmp_path, text, tokenizer_file):
    before = _tree(tmp_path)
    _one_line(cli, _build_args(text, tmp_path / ("d" * 252), tokenizer_file), "name too long (252 bytes")
    _one_line(cli, _build_args(text, tmp_path / ("d" * 300) / "data", tokenizer_file), "name too long ('ddd")
    deep = tmp_path.joinpath(*["d" * 200] * 21)
    _one_line(cli, _build_args(text, deep, tokenizer_file), "path too long")
    _one_line(cli, _build_args(tmp_path / ("i" * 300), tmp_path / "o", tokenizer_file), "file name too long")
    _one_line(cli, _build_args(text, tmp_path / "x" / "..", tokenizer_file, "--overwrite"), "not '.' or '..'")
    assert _tree(tmp_path) == before
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    _one_line(cli, _build_args(tmp_path / "loop.txt", tmp_path / "o", tokenizer_file), "a loop of symbolic links")
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(text, inputs / "a.txt")
    (inputs / "b.txt").symlink_to(inputs / "c.txt")
    (inputs / "c.txt").symlink_to(inputs / "b.txt")
    _one_line(cli, _build_args(inputs, tmp_path / "o", tokenizer_file), "b.txt: cannot read (a loop of symbolic links)")
    assert not (tmp_path / "o").exists()


def _set(path: list, value):
    def change(manifest):
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


MANIFESTS = [
    (_set(["tokenizer", "vocab_size"], "8192"), "field 'tokenizer.vocab_size' must be an integer"),
    (_set(["tokenizer", "eos_id"], 10**6), "field 'tokenizer.eos_id' must be an integer in 0.."),
    (_set(["tokenizer", "special_ids"], {"<eos>": "1"}), "field 'tokenizer.special_ids.<eos>' must be an integer"),
    (_set(["tokenizer", "sha256"], 5), "field 'tokenizer.sha256' must be a string"),
    (_set(["tokenizer", "sha256"], "not a hash"), "field 'tokenizer.sha256' must be a SHA-256"),
    (_set(["corpus", "text_bytes"], "many"), "field 'corpus.text_bytes' must be an integer"),
    (_set(["splits", "train", "shards"], {"file": "x"}), "field 'splits.train.shards' must be a list"),
    (_set(["splits", "train", "shards"], ["x"]), "field 'splits.train.shards.0' must be an object"),
    (_set(["splits", "train", "max_token_id"], "7"), "field 'splits.train.max_token_id' must be an integer"),
    (_set(["splits", "train", "num_documents"], 10**30), "field 'splits.train.num_documents' must be an integer"),
    (_set(["splits", "val", "documents", "bytes"], 3), "field 'splits.val.documents.bytes' is 3, but"),
    (_set(["loss_mask"], "yes"), "field 'loss_mask' must be true or false"),
    (_set(["splits", "train", "documents", "file"], "a\0b"), "must be a plain file name"),
]


@pytest.mark.parametrize(("change", "match"), MANIFESTS, ids=[m for _, m in MANIFESTS])
def test_a_manifest_field_of_the_wrong_type_is_one_line(cli, tmp_path, dataset, change, match):
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    before = _tree(tmp_path)
    line = _one_line(cli, ["data", "inspect", copy], match)
    assert line.startswith(f"zaya: error: {copy / 'manifest.json'}: ")
    assert _tree(tmp_path) == before


def test_a_tokenizer_that_is_not_one_is_one_line(cli, tmp_path, text):
    for content, match in [('{"model": 5}', "not a valid tokenizer.json"), (b"\xff\xfe{}", "not UTF-8"),
                           ("[" * 100_000, "not a valid tokenizer.json")]:
        path = tmp_path / "tokenizer.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        _one_line(cli, _build_args(text, tmp_path / "o", path), match)


def test_a_loader_state_of_the_wrong_types_is_one_line(dataset):
    with TokenLoader([(dataset, 1.0)], 16, seed=0) as loader:
        state = loader.state_dict()
        for change, match in [({"skip_ranges": 5}, "skip_ranges must be a list"),
                              ({"skip_ranges": ["ab"]}, "skip_ranges must be a list"),
                              ({"skip_ranges": [[0, 2**70]]}, "skip range"),
                              ({"consumed_samples": 10**30}, "consumed_samples must be a non-negative integer")]:
            with pytest.raises(ZayaError, match=match):
                loader.load_state_dict({**state, **change})
