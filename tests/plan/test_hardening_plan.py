"""`zaya shapes` and `zaya plan` against a careless or hostile user: outputs that are not zaya's are never
replaced, every number is bounded, and every file read is a bounded regular file whose fields are typed. Each
refusal is one line, before anything is measured."""

from __future__ import annotations

import json
import os

import pytest
import torch

import zaya.device
import zaya.plan.shapes as shapes_module
from zaya.errors import ZayaError
from zaya.plan.devices import peak_flops
from zaya.plan.shapes_cli import shapes as shapes_command
from zaya.plan.table import EfficiencyTable, GemmRecord, check_cache, default_table_path


def _one_line(cli, args, match):
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("zaya: error: ") and match in lines[0], err


def _table(preset: str = "micro") -> EfficiencyTable:
    return EfficiencyTable(
        device="cpu", device_label="Test CPU", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=5e-6, records=[GemmRecord("dense", 1024, 1024, 1024, 1, "fp32", 0.025, 2 * 1024**3)],
        preset=preset, measured_at="2025-01-01T00:00:00+00:00", torch_version="x")


@pytest.fixture
def zaya_cli(cli, monkeypatch, tmp_path):
    """The CLI with `shapes` mounted, the cache under tmp_path, and a sweep that records its calls and returns
    a made-up table at once (what is tested is what happens around the measurement)."""
    from zaya.cli import cli as group

    monkeypatch.setitem(group.commands, "shapes", shapes_command)
    monkeypatch.setenv("ZAYA_CACHE", str(tmp_path / "cache"))
    calls = []

    def sweep(*args, **kwargs):
        calls.append(args)
        return _table()

    monkeypatch.setattr(shapes_module, "sweep", sweep)
    cli.sweeps = calls
    return cli


def _special(tmp_path, kind: str):
    """A path holding something that is not a plain file zaya wrote, and a check that it is left as it was."""
    path = tmp_path / f"{kind}.json"
    if kind == "file":
        path.write_text("a user's file")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link":
        (tmp_path / "target.txt").write_text("the link's target")
        path.symlink_to(tmp_path / "target.txt")
    elif kind == "device":
        path.symlink_to("/dev/null")  # a device node behind a link: both refused
    elif kind == "dangling":
        path.symlink_to(tmp_path / "nowhere.json")
    snapshot = (path.is_symlink(), os.lstat(path).st_mode, path.read_text() if kind in ("file", "link") else None)

    def unchanged() -> bool:
        now = (path.is_symlink(), os.lstat(path).st_mode, path.read_text() if kind in ("file", "link") else None)
        return now == snapshot and not (tmp_path / "nowhere.json").exists()

    return path, unchanged


@pytest.mark.parametrize(("kind", "overwrite", "match"), [
    ("file", False, "already exists; pass --overwrite"),
    ("fifo", False, "not a regular file"), ("fifo", True, "not a regular file"),
    ("directory", True, "not a regular file"), ("link", True, "a symbolic link"),
    ("device", True, "a symbolic link"), ("dangling", True, "a symbolic link"),
])
def test_shapes_out_never_replaces_what_is_not_a_file_or_not_asked(zaya_cli, tmp_path, kind, overwrite, match):
    path, unchanged = _special(tmp_path, kind)
    _one_line(zaya_cli, ["shapes", "--out", path, *(["--overwrite"] if overwrite else [])], match)
    assert unchanged() and not zaya_cli.sweeps  # refused before the measurement


def test_shapes_out_replaces_a_file_with_overwrite(zaya_cli, tmp_path):
    path = tmp_path / "table.json"
    path.write_text("an older table")
    code, _, err = zaya_cli("shapes", "--out", path, "--overwrite", "--no-progress")
    assert code == 0, err
    assert EfficiencyTable.load(path) == _table() and os.listdir(tmp_path) == ["table.json"]


def test_the_cache_is_replaced_only_where_it_holds_a_table_zaya_wrote(zaya_cli, tmp_path):
    cache = default_table_path("fp32", tmp_path / "cache")
    cache.parent.mkdir(parents=True)
    cache.write_text('{"a user": "file"}')
    _one_line(zaya_cli, ["shapes", "--dtype", "fp32"], "not a GEMM table zaya wrote; refusing to replace it")
    assert cache.read_text() == '{"a user": "file"}' and not zaya_cli.sweeps
    cache.unlink()
    cache.symlink_to(tmp_path / "elsewhere.json")
    _one_line(zaya_cli, ["shapes", "--dtype", "fp32"], "a symbolic link; refusing to replace it")
    assert not (tmp_path / "elsewhere.json").exists()
    cache.unlink()
    _table(preset="tiny").save(cache)  # an older table of zaya's: replaced
    code, out, err = zaya_cli("shapes", "--dtype", "fp32", "--no-progress")
    assert code == 0, err
    assert f"wrote {cache}" in out and EfficiencyTable.load(cache).preset == "micro"
    with pytest.raises(ZayaError, match="already exists"):
        _table().save(cache)  # the API's save is no cache write: it replaces only when told
    check_cache(cache)


@pytest.mark.parametrize(("args", "match"), [
    (["--tokens", "100000000000"], "--tokens must be comma-separated integers in 1..16,777,216, got 100,000,000,000"),
    (["--tokens", "1e11"], "--tokens must be comma-separated integers in 1..16,777,216, got '1e11'"),
    (["--tokens", "0"], "got 0"), (["--tokens", "-5"], "got '-5'"), (["--tokens", "9" * 500], "got '9999"),
    (["--tokens", ","], "--tokens must be 1 to 64 comma-separated integers, got 0"),
    (["--tokens", ",".join(["8"] * 65)], "got 65"),
    (["--budget-s", "nan"], "--budget-s must be a number of seconds in (0, 86,400], got nan"),
    (["--budget-s", "inf"], "got inf"), (["--budget-s", "0"], "got 0.0"), (["--budget-s", "-1"], "got -1.0"),
    (["--budget-s", "1e300"], "got 1e+300"),
    (["--out", "x" * 300 + ".json"], "file name too long"),
])
def test_shapes_numbers_and_names_are_bounded_before_measuring(zaya_cli, tmp_path, monkeypatch, args, match):
    monkeypatch.chdir(tmp_path)
    _one_line(zaya_cli, ["shapes", "--out", tmp_path / "t.json", *args], match)
    assert not zaya_cli.sweeps and not (tmp_path / "t.json").exists()


def test_a_sweep_that_measures_nothing_writes_nothing(cli, monkeypatch, tmp_path):
    from zaya.cli import cli as group

    monkeypatch.setitem(group.commands, "shapes", shapes_command)
    # a peak of 1 FLOP/s: every shape would take longer than its cap, so every shape is skipped
    monkeypatch.setattr(zaya.device, "measure_matmul_flops", lambda device, dtype, **_: 1.0)
    monkeypatch.setattr(shapes_module, "measure_bandwidth", lambda device, megabytes=64: 2e10)
    _one_line(cli, ["shapes", "--preset", "micro", "--tokens", "256", "--out", tmp_path / "t.json", "--no-progress"],
              "no shape could be measured")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ZayaError, match=r"token counts must be integers in 1\.\.16,777,216, got 100000000000"):
        shapes_module.sweep("micro", "cpu", torch.float32, [10**11])


# ---- zaya plan ------------------------------------------------------------------------------------------------

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.toml")


@pytest.mark.parametrize(("args", "match"), [
    (["--gpus", "0"], "--gpus must be an integer in 1..131,072, got 0"),
    (["--gpus", "131073"], "got 131,073"), (["--gpus", str(10**30)], "--gpus must be an integer in 1..131,072"),
    (["--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node must be an integer in 1..1,024, got 0"),
    (["--gpus", "8", "--gpus-per-node", "100000000000"], "--gpus-per-node must be an integer in 1..1,024"),
    (["--top", "0"], "--top must be an integer in 1..1,000, got 0"), (["--top", "10000000"], "--top"),
])
def test_plan_counts_are_bounded(cli, args, match):
    _one_line(cli, ["plan", CONFIG, "--device", "h100", *args], match)


def _bad_tables(tmp_path) -> None:
    good = _table().to_dict()
    record = good["records"][0]
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "directory").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    documents = {
        "records": {**good, "records": "many"},
        "record_m": {**good, "records": [{**record, "m": "1024"}]},
        "record_huge": {**good, "records": [{**record, "k": 10**400}]},
        "record_seconds": {**good, "records": [{**record, "seconds": 0}]},
        "record_op": {**good, "records": [{**record, "op": "conv"}]},
        "peak": {**good, "peak_flops": "fast"},
        "peaks": {**good, "peaks": {"bf16": -1}},
        "tokens": {**good, "tokens": [0]},
        "label": {**good, "device_label": ["a"]},
        "deep": {**good, "skipped": json.loads("[" * 100 + "]" * 100)},
        "version": {**good, "version": "1" * 5000},
    }
    for name, document in documents.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(document))


@pytest.mark.parametrize(("name", "match"), [
    ("fifo", "a FIFO, not a regular file"), ("directory", "a directory, not a regular file"),
    ("loop", "a loop of symbolic links"), ("/dev/zero", "a character device, not a regular file"),
    ("records", "field 'records' must be a list"), ("record_m", "field 'records.0.m' must be an integer"),
    ("record_huge", "field 'records.0.k' must be an integer in 1..4,294,967,296"),
    ("record_seconds", "field 'records.0.seconds' must be a finite number in [1e-12, 1000000.0]"),
    ("record_op", "field 'records.0.op' must be one of 'dense', 'grouped', 'attention'"),
    ("peak", "field 'peak_flops' must be a finite number"), ("peaks", "field 'peaks.bf16' must be a number in (0"),
    ("tokens", "field 'tokens.0' must be an integer in 1..4,294,967,296"),
    ("label", "field 'device_label' must be a string"), ("deep", "nested more than 64 deep"),
    ("version", "GEMM table format version '1111"),
])
def test_plan_table_is_a_bounded_regular_file_with_typed_fields(cli, tmp_path, name, match):
    _bad_tables(tmp_path)
    path = name if name.startswith("/") else tmp_path / (name if name in ("fifo", "directory", "loop") else
                                                         f"{name}.json")
    # (fp32 named: `auto` would time this machine's matmuls first)
    _one_line(cli, ["plan", CONFIG, "--device", "local", "--set", "train.precision=fp32", "--table", path], match)


def test_a_kept_peak_is_read_bounded_and_never_replaced_unless_zaya_wrote_it(monkeypatch, tmp_path):
    monkeypatch.setattr("zaya.plan.devices.measure_matmul_flops", lambda *args, **kwargs: 3e10)
    assert "kept in" in peak_flops(torch.device("cpu"), torch.float32, tmp_path)[1]
    kept = next((tmp_path / "peak").iterdir())
    (tmp_path / "target").write_text("{}")
    for kind in ("fifo", "link", "file"):
        kept.unlink()
        if kind == "fifo":
            os.mkfifo(kept)  # read as a FIFO it would block: it is not read, and not replaced
        elif kind == "link":
            kept.symlink_to(tmp_path / "target")
        else:
            kept.write_text("a user's notes")
        value, said = peak_flops(torch.device("cpu"), torch.float32, tmp_path)
        assert (value, said) == (3e10, "measured"), kind
        assert {"fifo": kept.is_fifo, "link": kept.is_symlink, "file": lambda: kept.read_text() == "a user's notes"}[
            kind]()
        assert (tmp_path / "target").read_text() == "{}"
    kept.unlink()
    kept.write_text(json.dumps({"key": "another machine", "flops": 1.0}))  # zaya's own: replaced
    assert "kept in" in peak_flops(torch.device("cpu"), torch.float32, tmp_path)[1]
