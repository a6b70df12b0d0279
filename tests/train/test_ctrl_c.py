"""Ctrl-C keeps the work: once training runs, the first SIGINT stops the run after its step with a checkpoint
(exit 75, as SIGTERM) and the resumed run is the uninterrupted one; a second one aborts at once (exit 130), the
last committed checkpoint intact. Before the loop, and where SIGINT was inherited ignored, it means what it
always meant (zaya.train.stops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranks import wait_for
from runs import assert_same_run, committed_step, write_config
from zaya.config import load_config
from zaya.errors import EXIT_PREEMPTED
from zaya.resilience.diagnose import classify_files
from zaya.train.hooks import Hooks
from zaya.train.metrics import read_metrics
from zaya.train.stops import INTERRUPT_SAID, StopRequest
from zaya.training import build_trainer

# `zaya train` as a terminal starts it: a test runner started in the background (`make test &`) hands its
# children SIGINT ignored, and zaya leaves an ignored SIGINT ignored
_ZAYA_AT_A_TERMINAL = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from zaya.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler in this process for the test (the runner may have inherited it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _train(config: Path, run: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as stderr:  # a file: what it said so far can be read while it runs
        return subprocess.Popen([sys.executable, "-c", _ZAYA_AT_A_TERMINAL, "train", str(config), "--run-dir",
                                 str(run)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, **env}, start_new_session=True)



def _end(process: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return process.communicate(timeout=timeout)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(dataset,
                                                                                                   tmp_path):
    """A real `zaya train` and a real SIGINT from another process."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6}, checkpoint={"every": 4})
    build_trainer(load_config(config), tmp_path / "straight").run()
    run, log = tmp_path / "resumed", tmp_path / "stderr.txt"
    # every step takes 0.2 s at least, so that Ctrl-C lands before the last step on any machine
    process = _train(config, run, log, {"ZAYA_FAULTS": "slow=0.2@step:0"})
    wait_for(lambda: any(r["step"] >= 2 for r in read_metrics(run)), process, log)
    process.send_signal(signal.SIGINT)
    out = _end(process)
    err = log.read_text()
    assert process.returncode == EXIT_PREEMPTED, err[-4000:]  # as for SIGTERM
    assert err.count(INTERRUPT_SAID) == 1 and "Traceback" not in err, err
    last = max(r["step"] for r in read_metrics(run))
    assert 2 <= last < 6 and committed_step(run) == last  # nothing trained is lost
    assert f"stopped at step {last} (SIGINT); exit code {EXIT_PREEMPTED}" in out
    diagnosis = classify_files([run / "train.log"])
    assert diagnosis.root == "stopped" and f"at step {last} on SIGINT (Ctrl-C)" in diagnosis.detail, diagnosis

    build_trainer(load_config(config), run).run()
    assert_same_run(tmp_path / "straight", run)


def test_a_second_ctrl_c_aborts_at_once_and_keeps_the_last_checkpoint(dataset, tmp_path):
    """The step cannot end (a read that never returns): the first Ctrl-C waits for it, the second does not."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6}, checkpoint={"every": 1})
    run, log = tmp_path / "run", tmp_path / "stderr.txt"
    process = _train(config, run, log, {"ZAYA_FAULTS": "block@step:2"})
    wait_for(lambda: "zaya fault: block at step 2" in log.read_text(), process, log)
    process.send_signal(signal.SIGINT)
    wait_for(lambda: INTERRUPT_SAID in log.read_text(), process, log)
    signalled = time.monotonic()
    process.send_signal(signal.SIGINT)
    _end(process, timeout=60)
    err = log.read_text()
    assert process.returncode == 130 and "Traceback" not in err, err[-4000:]
    assert err.split("\n")[-2:] == ["zaya: aborted", ""] and time.monotonic() - signalled < 30
    assert committed_step(run) == 2 and not list((run / "checkpoints").glob("*.tmp"))
    assert "aborted by a second Ctrl-C (SIGINT)" in (run / "train.log").read_text()
    assert classify_files([run / "train.log"]).root == "stopped"


def test_ctrl_c_in_a_step_stops_the_run_after_it(dataset, tmp_path, python_sigint):
    """In-process: Ctrl-C in the middle of step 3 stops the run after it, as the stop rules' reduction says."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 50})

    def ctrl_c(event: str, step: int, path: Path | None = None) -> None:
        if event == "step-work" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    trainer = build_trainer(load_config(config), tmp_path / "run", hooks=Hooks([ctrl_c]))
    trainer.run()
    assert trainer.stopped == "SIGINT" and committed_step(tmp_path / "run") == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again after the run


def test_outside_the_loop_sigint_means_what_it_always_meant(python_sigint):
    with StopRequest(announce=False) as request:  # start-up: the loop has not begun
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs before this ends
        request.catch_interrupts()  # the loop begins
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert request.signal == signal.SIGINT and not request.aborted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert request.aborted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited ignored (a background job): it stays ignored
    with StopRequest(announce=False) as request:
        request.catch_interrupts()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert not request.requested and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
