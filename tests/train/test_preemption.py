"""Runs that survive the scheduler: SIGTERM / SIGUSR1 finish the step, checkpoint and exit 75; train.max_time_s
stops before a wall-clock limit; a time budget times the decay; the resumed run is the uninterrupted one.

The time rules run on a clock of the test's own (each step takes a fixed time of it), so that they are tested
the same on any machine, however busy."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranks import zaya_ranks
from runs import SteppedClock, assert_same_run, committed_step, write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.errors import EXIT_PREEMPTED
from zaya.train.hooks import Hooks
from zaya.train.metrics import read_metrics
from zaya.train.stops import StepClock, deadline_reached, time_origin, timed_decay
from zaya.training import build_trainer

# ---- the rules ----------------------------------------------------------------------------------------


def test_the_deadline_leaves_one_step_and_a_checkpoint():
    clock = StepClock([1.0, 3.0, 2.0], save_seconds=5.0)
    assert clock.step_seconds == 2.0 and clock.needed() == 8.0  # the slowest step, then the save
    assert not deadline_reached(100.0, origin=0.0, clock=clock, now=91.9)
    assert deadline_reached(100.0, origin=0.0, clock=clock, now=92.0)
    assert not deadline_reached(0.0, origin=0.0, clock=clock, now=1e9)  # no limit
    assert StepClock([2.0]).needed() == 22.0  # before any save: ten steps' worth for it


def test_the_timed_decay_starts_at_the_budgets_last_share():
    due = dict(budget_s=100.0, decay_fraction=0.3, warmup_steps=5, sample_seconds=2.0, planned_decay_start=1000)
    assert timed_decay(40, 69.9, **due) is None  # before 70% of the budget
    assert timed_decay(40, 70.0, **due) == 40 + 15  # 30 s left at 2 s per step (one sequence each)
    assert timed_decay(3, 80.0, **due) is None  # still warming up
    assert timed_decay(40, 70.0, **{**due, "planned_decay_start": 40}) is None  # max_steps' decay comes first
    assert timed_decay(40, 70.0, **{**due, "planned_decay_start": 50}) == 50  # ... or cuts it short
    assert timed_decay(40, 120.0, **due) == 41  # over budget: one decay step, then done
    # a ramp doubling the batch after 10 more sequences: 10 steps of 1 (20 s), then 9 s = 2.25 steps of 2
    ramp = dict(samples=100, batch_at=lambda samples: 1 if samples < 110 else 2)
    assert timed_decay(40, 71.0, **due, **ramp) == 40 + 10 + 2


def test_the_job_clock_is_slurms_when_there_is_one():
    assert time_origin({"SLURM_JOB_START_TIME": "1700000000"}) == 1700000000.0
    assert 0 <= time.time() - time_origin({}) < 3600  # this process's start


# ---- signals ------------------------------------------------------------------------------------------


def test_a_signal_mid_step_stops_after_it_with_a_checkpoint_and_resume_is_bitwise_identical(dataset, tmp_path):
    """SIGUSR1 here; SIGTERM from outside to a real process below."""
    sig = "sigusr1"
    config = load_config(write_config(tmp_path / "run.toml", dataset, checkpoint={"every": 4, "keep": 2}))
    build_trainer(config, tmp_path / "straight").run()

    stopped = build_trainer(config, tmp_path / "resumed", environ={"ZAYA_FAULTS": f"{sig}@step:5"})
    stopped.run()
    assert stopped.stopped == sig.upper()
    assert committed_step(tmp_path / "resumed") == 6  # step 5 (the sixth) finished, then its checkpoint
    assert max(r["step"] for r in read_metrics(tmp_path / "resumed")) == 6
    assert f"stopping at step 6 on {sig.upper()}" in (tmp_path / "resumed" / "train.log").read_text()

    build_trainer(config, tmp_path / "resumed").run()
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")


def _start(config: Path, run: Path, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "zaya.cli", "train", str(config), "--run-dir", str(run)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _wait_for_step(process: subprocess.Popen, run: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in read_metrics(run)):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise AssertionError(f"no step {step} within {timeout} s: {process.communicate()[1][-4000:]}")
        time.sleep(0.05)


def _finish(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    finally:
        process.kill()


@pytest.mark.slow
def test_sigterm_from_outside_at_any_moment_exits_75_and_resumes(dataset, tmp_path):
    """The scheduler's way: a signal from another process, whenever it comes, to a real `zaya train`."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 10}, checkpoint={"every": 5})
    build_trainer(load_config(config), tmp_path / "straight").run()
    run = tmp_path / "resumed"
    # every step takes 0.2 s at least, so that the signal lands before the last step on any machine
    process = _start(config, run, env={"ZAYA_FAULTS": "slow=0.2@step:0"})
    _wait_for_step(process, run, 3)
    process.send_signal(signal.SIGTERM)
    out, err = _finish(process)
    assert process.returncode == EXIT_PREEMPTED, err
    last = max(r["step"] for r in read_metrics(run))
    assert 3 <= last < 10 and committed_step(run) == last  # nothing trained is lost
    assert f"stopped at step {last} (SIGTERM); exit code {EXIT_PREEMPTED}" in out
    build_trainer(load_config(config), run).run()
    assert_same_run(tmp_path / "straight", run)


def test_more_signals_change_nothing(dataset, tmp_path):
    """A scheduler signals every process of the job and torchrun passes its copy on: duplicates are the rule, in
    the step and during the stop's checkpoint."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 50})
    run = tmp_path / "run"
    trainer = build_trainer(load_config(config), run,
                            environ={"ZAYA_FAULTS": "sigterm@step:2,sigusr1@step:2,sigterm@checkpoint:3"})
    trainer.run()
    assert trainer.stopped == "SIGTERM"
    last = max(r["step"] for r in read_metrics(run))
    assert committed_step(run) == last == 3 and "stopping at step 3 on SIGTERM" in (run / "train.log").read_text()


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 12}, checkpoint={"every": 5})
    run = tmp_path / "run"
    results = zaya_ranks(["train", config, "--run-dir", run], 2, env={"ZAYA_FAULTS": "sigterm@step:6@rank=1"})
    assert [code for code, _, _ in results] == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    assert sum(out.count(f"exit code {EXIT_PREEMPTED}") for _, out, _ in results) == 1  # rank 0 says it, once
    log = (run / "train.log").read_text() + (run / "logs" / "rank-1.log").read_text()
    assert "stopping at step 7 on a signal to another rank" in log and "stopping at step 7 on SIGTERM" in log
    assert committed_step(run) == 7
    (shards,) = {len(list((ckpt.resolve_checkpoint(run)).glob("*.distcp")))}
    assert shards == 2


# ---- time ---------------------------------------------------------------------------------------------


def test_max_time_s_stops_in_time_with_a_checkpoint(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 10_000, "max_time_s": 400.0,
                                                                 "eval_every": 0},
                          checkpoint={"every": 1000})
    clock = SteppedClock(10.0)
    run = tmp_path / "run"
    trainer = build_trainer(load_config(config), run, clock=clock, timer=clock, origin=0.0,
                            hooks=Hooks([clock.listen]))
    trainer.run()
    assert trainer.stopped == "max_time_s"
    last = max(r["step"] for r in read_metrics(run))
    assert committed_step(run) == last
    # it stopped at the first step after which one more step (10 s) and a checkpoint (before the first: ten
    # steps' worth) would no longer fit in the 400 s: the checkpoint was committed in time
    assert 10 * last + 10 + 100 >= 400 > 10 * (last - 1) + 10 + 100
    assert "stopping at step" in (run / "train.log").read_text() and "train.max_time_s = 400 s" in \
        (run / "train.log").read_text()

    # resumed with no time left for one more step and a checkpoint, it stops before its first step
    again = build_trainer(load_config(config), run, clock=clock, timer=clock, origin=0.0, hooks=Hooks([clock.listen]))
    again.run()
    assert again.stopped == "max_time_s" and max(r["step"] for r in read_metrics(run)) == last


def test_a_time_budget_times_the_decay_and_ends_the_run(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": 100_000, "time_budget_s": 40.0, "eval_every": 0},
                          schedule={"warmup_steps": 2, "decay_fraction": 0.4}, checkpoint={"every": 1000})
    clock = SteppedClock(1.0)
    run = tmp_path / "run"
    build_trainer(load_config(config), run, clock=clock, timer=clock, hooks=Hooks([clock.listen])).run()
    rows = read_metrics(run)
    state = ckpt.read_json(ckpt.resolve_checkpoint(run) / ckpt.TRAIN_STATE_FILE)["state"]
    start, end = state["decay_start"], state["schedule_steps"]
    assert rows[-1]["step"] == end and 0 < start < end < 100_000
    lrs = {r["step"]: r["lr_multiplier"] for r in rows}
    # a row's multiplier is the one its optimizer step (row step - 1) took: the decay's steps are start .. end - 1,
    # step s at t = (s + 1 - start) / (end - start), the last at t = 1
    assert lrs[start] == 1.0 and all(lrs[s] < 1.0 for s in range(start + 1, end + 1))
    assert lrs[start + 3] == pytest.approx(1 - (3 / (end - start)) ** 0.5, abs=1e-9)  # the 1-sqrt shape
    assert lrs[end] == 0.0
    # at 1 s per step the decay starts once 60% of the 40 s are spent (a step's second counts from its own end)
    # and the run ends with the budget: 40 s of wall time (its steps' times are added one step late)
    assert (start, end, state["train_seconds"], state["run_seconds"]) == (24, 40, 39, 40)
    line = next(x for x in (run / "train.log").read_text().splitlines() if "time budget" in x)
    assert f"from step {start} to step {end}" in line
    json.dumps(state)  # the decision travels in the checkpoint


class _LoadedClock(SteppedClock):
    """Steps of `step_s` seconds until `from_step`, then of `later_s`: the machine got busy (or free)."""

    def __init__(self, step_s: float, from_step: int, later_s: float):
        super().__init__(step_s)
        self.from_step, self.later_s = from_step, later_s

    def listen(self, event: str, step: int, path: Path | None = None) -> None:
        if event == "step-work":
            self.now += self.later_s if step >= self.from_step else self.step_s


@pytest.mark.parametrize("later_s", [2.0, 0.5], ids=["slower", "faster"])
def test_a_time_budget_ends_with_its_time_when_the_load_changes_during_the_decay(dataset, tmp_path, later_s):
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": 100_000, "time_budget_s": 40.0, "eval_every": 0},
                          schedule={"warmup_steps": 2, "decay_fraction": 0.4}, checkpoint={"every": 1000},
                          logging={"log_every": 1})
    clock = _LoadedClock(1.0, 30, later_s)  # the decay begins near step 25 and is planned at 1 s a step
    run = tmp_path / "run"
    build_trainer(load_config(config), run, clock=clock, timer=clock, hooks=Hooks([clock.listen])).run()
    rows = read_metrics(run)
    trained = sum(row["step_time"] for row in rows)
    assert abs(trained - 40.0) <= 0.05 * 40.0, (trained, len(rows))  # at a fixed plan: 52 s slower, 34.5 faster
    lrs = [row["lr_multiplier"] for row in rows]
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:])) and lrs[-1] == 0.0  # after the warmup


class _PausingClock(SteppedClock):
    """Steps of `step_s` seconds, and every evaluation takes `eval_s` of the same clock."""

    def __init__(self, step_s: float, eval_s: float):
        super().__init__(step_s)
        self.eval_s = eval_s

    def listen(self, event: str, step: int, path: Path | None = None) -> None:
        super().listen(event, step, path)
        if event == "eval":
            self.now += self.eval_s


def test_a_time_budget_counts_evaluations_and_ends_with_the_wall_clock(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": 100_000, "time_budget_s": 60.0, "eval_every": 4, "eval_batches": 1},
                          schedule={"warmup_steps": 2, "decay_fraction": 0.4}, checkpoint={"every": 1000})
    clock = _PausingClock(1.0, 2.0)  # a third of the loop's time goes to evaluations
    run = tmp_path / "run"
    build_trainer(load_config(config), run, clock=clock, timer=clock, hooks=Hooks([clock.listen])).run()
    rows = read_metrics(run)
    # counted in steps alone, the run would have taken about 90 s
    assert 57.0 <= clock.now <= 63.0 and 36 <= rows[-1]["step"] <= 44, (clock.now, rows[-1]["step"])
    assert rows[-1]["lr_multiplier"] == 0.0


@pytest.mark.slow
def test_torchrun_passes_sigusr1_on_as_the_slurm_example_sets_it_up(dataset, tmp_path):
    """examples/slurm/train.sbatch: USR1 to torchrun, which hands it to its workers (--signals-to-handle)."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 60}, checkpoint={"every": 50})
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
               "--shutdown-timeout", "60", "-m", "zaya.cli", "train", str(config), "--run-dir", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_FAULTS": "slow=0.3@step:0"},
                               start_new_session=True)
    try:
        _wait_for_step(process, run, 3, timeout=180)
        process.send_signal(signal.SIGUSR1)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    last = max(r["step"] for r in read_metrics(run))
    assert 3 <= last < 60 and committed_step(run) == last, err[-4000:]
    assert f"stopping at step {last} on SIGUSR1" in (run / "train.log").read_text()
    assert f"exit code {EXIT_PREEMPTED}" in out


def test_a_process_blocked_in_io_still_ends_within_its_grace_after_sigterm(dataset, tmp_path):
    """A read that never returns (a FIFO no one writes) cannot finish its step: the request's grace ends it."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6, "stop_grace_s": 2.0},
                          checkpoint={"every": 1})
    run = tmp_path / "run"
    process = _start(config, run, env={"ZAYA_FAULTS": "block@step:2"})
    _wait_for_step(process, run, 2)
    time.sleep(0.5)  # into the blocking read
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = _finish(process, timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert 2.0 <= time.monotonic() - signalled < 30
    assert "zaya: error: 2 s after SIGTERM, no checkpoint written (blocked in I/O or in a collective?)" in err
    assert committed_step(run) == 2  # what was committed before stays


def test_a_checkpoint_save_that_hangs_ends_the_process_within_its_timeout(dataset, tmp_path):
    """Storage that stops answering during a save (a read of a FIFO no one writes, inside the save): the save's
    deadline ends the process in one line; the checkpoint before it stays the newest committed one."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 4},
                          checkpoint={"every": 1, "timeout_s": 2.0})
    run = tmp_path / "run"
    started = time.monotonic()
    process = _start(config, run, env={"ZAYA_FAULTS": "block@checkpoint-written:2"})
    _, err = _finish(process, timeout=120)
    assert process.returncode == 1, err[-3000:]
    assert "zaya: error: checkpoint step 2's save did not finish within 2 s (checkpoint.timeout_s)" in err
    assert time.monotonic() - started < 100
    assert committed_step(run) == 1 and (run / "checkpoints" / "step_00000002.tmp").is_dir()
