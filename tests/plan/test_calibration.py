"""`zaya plan --calibrate-from RUN`: a run's measured step time and memory folded into its device's figures, and
the next `zaya plan` planning with them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runs import write_config
from zaya.cli import main
from zaya.config import load_config
from zaya.plan.calibration import (
    Calibration,
    calibrated,
    calibration_path,
    measured_rows,
    read_calibration,
)
from zaya.plan.devices import get_device
from zaya.plan.planner import plan_run
from zaya.plan.table import EfficiencyTable, GemmRecord, default_table_path
from zaya.training import build_trainer

WORLD = 2


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ZAYA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _zaya(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _plan(config_path: Path, device: str = "h100", world: int = WORLD):
    """The uncalibrated plan of the config on `world` ranks of `device`, in fp32 (the config's precision)."""
    return plan_run(load_config(config_path).resolve(world, "fp32"), get_device(device), None, world)


def _run_dir(tmp_path: Path, steps: int = 10, scale: float = 2.0, memory: float = 1.5, world: int = WORLD,
             start: int = 1) -> tuple[Path, Path]:
    """(config, run directory) of a run written by hand: its resolved config and `steps` metrics rows whose step
    times are `scale` times the plan's on h100 and peaks `memory` times its memory."""
    config = write_config(tmp_path / "run.toml", tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    record = load_config(config).resolve(world, "fp32").record
    (run_dir / "run_config.json").write_text(json.dumps(record), encoding="utf-8")
    phase = _plan(config, world=world).first
    rows = [{"step": step, "step_time": scale * phase.time.total, "batch_size": 8, "phase": "main",
             "peak_memory_bytes": [round(memory * phase.memory.total)] * world}
            for step in range(start, start + steps)]
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
    return config, run_dir


def test_the_factors_make_the_next_plan_predict_what_the_run_measured(tmp_path, cache, capsys):
    config, run_dir = _run_dir(tmp_path)
    phase = _plan(config).first
    code, out, err = _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "h100")
    assert code == 0, err
    line = _one_line(out)
    path = calibration_path(cache, "h100", "fp32")
    assert "compute x" in line and "memory x1.500" in line and str(path) in line and "layout = \"auto\"" in line
    found = read_calibration(path)
    time = phase.time
    assert found.compute_factor == pytest.approx((2 * time.total - time.comm_exposed) / time.compute, rel=1e-12)
    assert found.memory_factor == pytest.approx(1.5, rel=1e-6)
    assert found.rows == 8 and found.gpus == WORLD and found.run == str(run_dir.resolve())  # 2 of 10 warm up
    assert found.measured_step_s == pytest.approx(2 * time.total) and found.predicted_step_s == time.total

    spec = calibrated(get_device("h100"), cache, "fp32")
    assert "calibrated from" in spec.label and spec.calibrated_from == found.run
    assert time.scaled(spec.compute_factor).total == pytest.approx(2 * time.total, rel=1e-6)
    assert phase.memory.scaled(spec.memory_factor).total == pytest.approx(1.5 * phase.memory.total, rel=1e-6)

    # the next `zaya plan` plans with it; --uncalibrated without
    code, out, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["step_time_s"] == pytest.approx(2 * time.total, rel=1e-6)
    assert data["calibration"]["compute_factor"] == found.compute_factor
    code, out, _ = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100")
    assert "calibrated from" in out and "calibrated: compute time x" in out
    code, out, _ = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100", "--json", "--uncalibrated")
    data = json.loads(out)
    assert data["step_time_s"] == pytest.approx(time.total, rel=1e-9) and data["calibration"] is None
    code, out, _ = _zaya(capsys, "plan", "--devices")
    assert code == 0 and "h100     fp32  compute x" in out and "memory x1.500" in out


def test_a_file_not_zayas_is_never_replaced_and_a_bad_one_is_one_line(tmp_path, cache, capsys):
    config, run_dir = _run_dir(tmp_path)
    path = calibration_path(cache, "h100", "fp32")
    path.parent.mkdir(parents=True)
    path.write_text("my notes\n", encoding="utf-8")
    code, out, err = _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "h100")
    assert code == 2 and out == "" and "not a calibration zaya wrote; refusing to replace it" in _one_line(err)
    assert path.read_text(encoding="utf-8") == "my notes\n"
    path.unlink()
    os.symlink(tmp_path / "elsewhere.json", path)
    code, _, err = _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "h100")
    assert code == 2 and "symbolic link" in _one_line(err) and not (tmp_path / "elsewhere.json").exists()
    (tmp_path / "elsewhere.json").write_text("{}", encoding="utf-8")  # nor read through a link
    code, _, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100")
    assert code == 2 and "symbolic link" in _one_line(err)
    path.unlink()

    # zaya's own is replaced; one of its fields broken is one line naming the file and the field
    assert _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "h100")[0] == 0
    assert _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "h100")[0] == 0
    data = json.loads(path.read_text(encoding="utf-8"))
    for field, value in (("compute_factor", "fast"), ("compute_factor", 1e9), ("memory_factor", -1),
                         ("rows", 2), ("device", "h200")):
        path.write_text(json.dumps({**data, field: value}), encoding="utf-8")
        code, out, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100")
        assert code == 2 and out == ""
        assert str(path) in _one_line(err) and f"'{field}'" in err, err
    path.write_text(" " * (1 << 20) + json.dumps(data), encoding="utf-8")
    code, _, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100")
    assert code == 2 and "larger than 1 MiB" in _one_line(err)
    path.unlink()
    os.mkfifo(path)
    code, _, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100")
    assert code == 2 and "FIFO" in _one_line(err)
    # the listing says which file is unusable, and lists the rest
    code, out, _ = _zaya(capsys, "plan", "--devices")
    assert code == 0 and "h100-fp32.json: unusable" in out
    # --uncalibrated plans without reading it
    code, _, err = _zaya(capsys, "plan", config, "--gpus", WORLD, "--device", "h100", "--uncalibrated")
    assert code == 0, err


@pytest.mark.parametrize("case", ["missing", "a-file", "no-metrics", "no-config", "too-few", "bad-flags"])
def test_a_run_that_cannot_calibrate_is_one_line_and_nothing_written(tmp_path, cache, capsys, case):
    config, run_dir = _run_dir(tmp_path, steps=6 if case == "too-few" else 10)
    args = ["plan", "--calibrate-from", run_dir, "--device", "h100"]
    message = {"missing": "no such directory", "a-file": "not a directory", "no-metrics": "no metrics.jsonl",
               "no-config": "not the directory of a run zaya trained", "too-few": "fewer than the 5",
               "bad-flags": "--gpus does not apply"}[case]
    if case == "missing":
        args[2] = tmp_path / "nowhere"
    elif case == "a-file":
        args[2] = config
    elif case == "no-metrics":
        (run_dir / "metrics.jsonl").unlink()
    elif case == "no-config":
        (run_dir / "run_config.json").unlink()
    elif case == "bad-flags":
        args += ["--gpus", "2"]
    code, out, err = _zaya(capsys, *args)
    assert code == 2 and out == "" and message in _one_line(err), err
    assert not (cache / "calibration").exists()


def test_only_the_last_starts_rows_count(tmp_path):
    # 10 rows on one rank, then a start on two: the second start's rows alone, less its warm-up
    _run_dir(tmp_path, steps=10, world=1)
    _, run_dir = _run_dir(tmp_path, steps=10, world=WORLD, start=11)
    rows = measured_rows(run_dir, 8)
    assert [row.step for row in rows] == list(range(13, 21)) and {row.world for row in rows} == {WORLD}
    # a resume on as many ranks, as train.log says it: the rows after it
    (run_dir / "train.log").write_text("2025-01-01 00:00:00 resumed from run/checkpoints/step_14 (step 14, phase "
                                       "'main', written by 2 rank(s))\n", encoding="utf-8")
    assert [row.step for row in measured_rows(run_dir, 8)] == list(range(17, 21))
    # rows of another batch size (a ramp's) are not what the plan is of
    assert measured_rows(run_dir, 16) == []


def test_a_cpu_run_calibrates_the_step_time_not_the_memory(dataset, tmp_path, cache, capsys):
    # a table as `zaya shapes` writes it for this machine (its figures made up: what is tested is their use)
    table = EfficiencyTable(
        device="cpu", device_label="Test CPU", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=5e-6, records=[GemmRecord("dense", 1024, 1024, 1024, 1, "fp32", 0.025, 2 * 1024**3)],
        preset="micro", measured_at="2025-01-01T00:00:00+00:00", torch_version="x",
        peaks={"fp32": 1e11, "bf16": 1e9}, memory_bytes=24 * 10**9, tokens=[1024],
    )
    table.save(default_table_path("fp32", cache))
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 9, "eval_every": 0},
                          checkpoint={"every": 4})
    run_dir = tmp_path / "run"
    build_trainer(load_config(config), run_dir, environ={"ZAYA_CACHE": str(cache)}).run()
    capsys.readouterr()  # the run's own output
    code, out, err = _zaya(capsys, "plan", "--calibrate-from", run_dir, "--device", "local")
    assert code == 0, err
    assert "memory not calibrated" in _one_line(out)
    found = read_calibration(calibration_path(cache, "local", "fp32"))
    assert isinstance(found, Calibration) and found.memory_factor is None and found.rows == 7
    assert 0.05 <= found.compute_factor <= 20 and found.gpus == 1
    code, out, _ = _zaya(capsys, "plan", config, "--device", "local", "--json")
    data = json.loads(out)
    assert data["calibration"] == {"compute_factor": found.compute_factor, "memory_factor": 1.0,
                                   "run": found.run}
