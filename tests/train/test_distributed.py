"""Data parallelism under torchrun on gloo: two ranks train like one process, and checkpoints move between
world sizes."""

import os
import subprocess
import sys

import pytest

from conftest import write_config
from zaya.config import load_config
from zaya.train.metrics import read_metrics
from zaya.train.trainer import Trainer


def _torchrun(config, run_dir, nproc: int, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "-m", "zaya.cli", "train", str(config), "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_two_ranks_match_one_process_and_resume_on_one(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6, "eval_every": 3},
                          checkpoint={"every": 3})
    Trainer(load_config(config), tmp_path / "single").run()
    result = _torchrun(config, tmp_path / "pair", 2, env={"ZAYA_FAULTS": "sigkill@step:5"})
    assert result.returncode != 0  # a rank was killed after the checkpoint of step 3
    single = read_metrics(tmp_path / "single")
    # resume the two-rank run's checkpoint in one process: a different world size, the same samples
    Trainer(load_config(config), tmp_path / "pair").run()
    pair = read_metrics(tmp_path / "pair")
    assert [r["step"] for r in pair] == [r["step"] for r in single]
    for a, b in zip(single, pair, strict=True):
        assert a["batch_size"] == b["batch_size"]
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-4)
        if "eval_loss" in a:
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=2e-4)
