"""`zaya train` prints the plan's prediction at startup and, after 20 steps, the measured figures beside it."""

from __future__ import annotations

from pathlib import Path

import torch

from runs import write_config
from zaya.config import load_config
from zaya.plan.forecast import STEPS
from zaya.plan.shapes import sweep
from zaya.plan.table import default_table_path
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
    assert "GB per GPU" in startup and "no step-time prediction" in startup
    measured = next(line for line in log.splitlines() if "measured over steps" in line)
    assert f"steps 2-{STEPS + 1}" in measured and "peak memory" in measured and "(plan " in measured


def test_with_the_table_of_zaya_shapes_the_step_time_is_compared(dataset, tmp_path):
    table = sweep("micro", "cpu", torch.float32, [64], progress=False, budget_s=5)
    table.save(default_table_path("fp32", tmp_path / "cache"))
    log = _train(tmp_path, dataset)
    startup = next(line for line in log.splitlines() if "plan (local)" in line)
    assert "tokens/s per GPU" in startup and "no step-time prediction" not in startup
    measured = next(line for line in log.splitlines() if "measured over steps" in line)
    assert "step " in measured and "tokens/s per GPU" in measured
