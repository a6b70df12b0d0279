"""How a run's end is told: an error that ends training is in train.log, and a rerun of a finished run says why
there is nothing to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from runs import SteppedClock, write_config
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.train.hooks import Hooks
from zaya.training import build_trainer


@pytest.mark.parametrize(("error", "line"), [
    (ZayaError("the data went away"), "zaya: error: the data went away"),  # as the command prints it
    (RuntimeError("a bug\nand its second line"), "RuntimeError: a bug"),  # its traceback goes to stderr
], ids=["bad-input", "bug"])
def test_an_error_that_ends_training_ends_train_log(dataset, tmp_path, error, line):
    def fail(event: str, step: int, path: Path | None = None) -> None:
        if event == "step" and step == 2:
            raise error

    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 5, "eval_every": 0})
    run = tmp_path / "run"
    with pytest.raises(type(error)):
        build_trainer(load_config(config), run, hooks=Hooks([fail])).run()
    last = (run / "train.log").read_text(encoding="utf-8").splitlines()[-1]
    assert last.endswith(f" {line}"), last


def test_a_rerun_of_a_run_whose_time_budget_is_spent_says_so(dataset, tmp_path, cli):
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": 1000, "time_budget_s": 4.0, "eval_every": 0},
                          schedule={"warmup_steps": 1, "decay_fraction": 0.5}, checkpoint={"every": 1000})
    run = tmp_path / "run"
    clock = SteppedClock(1.0)
    last = build_trainer(load_config(config), run, clock=clock, timer=clock, hooks=Hooks([clock.listen])).run()
    code, out, _ = cli("train", config, "--run-dir", run)
    assert code == 0
    assert out.splitlines()[-1] == (f"nothing to do: {run} spent its time budget (train.time_budget_s = 4 s, 4 s "
                                    f"spent) and "
                           f"ended with its learning-rate decay at step {last['step']} (of train.max_steps = 1,000); "
                           f"to train on from its weights, start a new run: --set train.init_from={run} --run-dir "
                           "ANOTHER_DIR"), out


def test_a_rerun_of_a_run_at_its_last_step_says_so(dataset, tmp_path, cli):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 3, "eval_every": 0})
    run = tmp_path / "run"
    build_trainer(load_config(config), run).run()
    code, out, _ = cli("train", config, "--run-dir", run)
    assert code == 0 and out.splitlines()[-1] == f"nothing to do: {run} is already at step 3 of train.max_steps = 3"
