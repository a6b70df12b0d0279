"""`zaya train` prints the plan's prediction at startup and, after 20 steps, the measured figures beside it."""

from __future__ import annotations

from pathlib import Path

from runs import write_config
from zaya.config import load_config
from zaya.plan.forecast import STEPS
from zaya.plan.table import EfficiencyTable, GemmRecord, default_table_path
from zaya.training import build_trainer


def _train(tmp_path: Path, dataset: Path) -> str:
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": STEPS + 2, "eval_every": 0},
                          optim={"lr": 0.01, "ns_dtype": "float32"},  # the table's precision
                          checkpoint={"every": 100})
    run_dir = tmp_path / "run"
    build_trainer(load_config(config), run_dir, environ={"ZAYA_CACHE": str(tmp_path / "cache")}).run()
    return (run_dir / "train.log").read_text(encoding="utf-8")


def test_without_a_measured_table_the_memory_is_predicted_and_compared(dataset, tmp_path):
    log = _train(tmp_path, dataset)
    startup = next(line for line in log.splitlines() if "plan (local)" in line)
    assert "GB per CPU process" in startup and "GB available" in startup and "no step-time prediction" in startup
    measured = next(line for line in log.splitlines() if "measured over steps" in line)
    assert f"steps 2-{STEPS + 1}" in measured and "peak memory" in measured and "(plan " in measured


def test_with_the_table_of_zaya_shapes_the_step_time_is_compared(dataset, tmp_path):
    # a table as `zaya shapes` writes it for this machine (its figures made up: what is tested is their use)
    table = EfficiencyTable(
        device="cpu", device_label="Test CPU", dtype="fp32", peak_flops=1e11, memory_bandwidth=2e10,
        op_overhead_s=5e-6, records=[GemmRecord("dense", 1024, 1024, 1024, 1, "fp32", 0.025, 2 * 1024**3)],
        preset="micro", measured_at="2025-01-01T00:00:00+00:00", torch_version="x",
        peaks={"fp32": 1e11, "bf16": 1e9}, memory_bytes=24 * 10**9, tokens=[1024],
    )
    table.save(default_table_path("fp32", tmp_path / "cache"))
    log = _train(tmp_path, dataset)
    startup = next(line for line in log.splitlines() if "plan (local)" in line)
    assert "tokens/s per CPU process" in startup and "no step-time prediction" not in startup
    measured = next(line for line in log.splitlines() if "measured over steps" in line)
    assert "step " in measured and "tokens/s per CPU process" in measured
