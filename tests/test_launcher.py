"""`zaya launch`: torchrun's options as torchrun reads them, a zaya command on every worker, and an end in one
line where torchrun's is a traceback: a signal (a checkpoint first, exit 128 + the signal), a second Ctrl-C (the
workers abort at once), a failed worker (its exit code)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranks import wait_for
from runs import committed_step, write_config
from zaya.errors import ZayaError
from zaya.launcher import torchrun_args
from zaya.resilience.processes import descendants
from zaya.train.metrics import read_metrics
from zaya.train.stops import INTERRUPT_SAID

COMMANDS = ["eval", "generate", "train"]


def test_the_options_are_torchruns_and_the_program_is_a_zaya_command():
    args = torchrun_args(["--nproc_per_node=2", "--standalone", "--shutdown-timeout", "90", "train", "x.toml",
                          "--set", "train.max_steps=3", "--run-dir", "runs/x"], COMMANDS)
    assert (args.nproc_per_node, args.standalone, args.shutdown_timeout) == ("2", True, 90)
    assert (args.module, args.training_script) == (True, "zaya.cli")
    assert args.training_script_args == ["train", "x.toml", "--set", "train.max_steps=3", "--run-dir", "runs/x"]


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "2", "-m", "zaya.cli", "train"], "-m, --no-python and --run-path do not apply"),
    (["--nproc-per-node", "2", "--no-python", "train"], "-m, --no-python and --run-path do not apply"),
    (["--nproc-per-node", "2", "trian", "x.toml"], "'trian' is not a zaya command"),
    ([], "needs torchrun's options and then the zaya command"),
])
def test_what_is_not_a_zaya_command_is_one_line(argv, message):
    with pytest.raises(ZayaError, match=message):
        torchrun_args(argv, COMMANDS)


# The launcher's process with one worker (a child leading a process group of its own, as torchrun starts them)
# that exits 42 on SIGINT: the agent's handler, as the launcher patches it, signalled twice.
_TWO_SIGNALS = """
import signal, subprocess, sys
from torch.distributed.elastic.multiprocessing import api
from zaya.launcher import _second_signal_to_workers

worker = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                           "signal.signal(signal.SIGINT, lambda *a: sys.exit(42)); print(flush=True); time.sleep(60)"],
                          stdout=subprocess.PIPE, start_new_session=True)
worker.stdout.readline()
original = api._terminate_process_handler
with _second_signal_to_workers():
    try:
        api._terminate_process_handler(signal.SIGINT, None)
    except api.SignalException as exc:  # the first: the agent's own, which passes it on itself
        print("raised", exc.sigval.name, worker.poll())
    api._terminate_process_handler(signal.SIGINT, None)  # the second: to the worker, at once
    print("worker", worker.wait(timeout=60))
print("restored", api._terminate_process_handler is original)
"""


def test_the_agents_first_signal_is_its_own_and_a_second_goes_to_the_workers():
    result = subprocess.run([sys.executable, "-c", _TWO_SIGNALS], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n") == ["raised SIGINT None", "worker 42", "restored True", ""], result.stderr


def _launch(config: Path, run: Path, stderr: Path, faults: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "zaya.cli", "launch", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.2", "train", str(config), "--run-dir", str(run)]
    with open(stderr, "wb") as err:  # a file: what it said so far can be read while it runs
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_FAULTS": faults})



def _end(process: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return process.communicate(timeout=timeout)[0]
    finally:  # the launcher, and any worker it left behind (each in a session of its own)
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err[-6000:]
    (line,) = [x for x in err.splitlines() if x.startswith("zaya launch:")]
    return line


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
def test_a_signal_to_the_launcher_stops_the_workers_with_a_checkpoint_in_one_line(dataset, tmp_path, sig):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 60}, checkpoint={"every": 50})
    run, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    process = _launch(config, run, stderr, "slow=0.3@step:0")  # 0.3 s a step at least: it cannot end first
    wait_for(lambda: any(r["step"] >= 2 for r in read_metrics(run)), process, stderr, timeout=180)
    process.send_signal(sig)
    out = _end(process)
    err = stderr.read_text()
    assert process.returncode == 128 + sig.value, err[-6000:]
    assert f"{sig.name}: passed on to the workers" in _one_line(err)
    last = max(r["step"] for r in read_metrics(run))
    assert 2 <= last < 60 and committed_step(run) == last  # both ranks stopped at one step, with its checkpoint
    assert f"stopped at step {last} ({sig.name}); exit code 75" in out
    assert (INTERRUPT_SAID in err) == (sig == signal.SIGINT)  # said by rank 0 alone
    assert err.count(INTERRUPT_SAID) <= 1


@pytest.mark.slow
def test_a_second_ctrl_c_reaches_the_workers_which_abort_at_once(dataset, tmp_path):
    """torchrun's agent, already stopping, would raise again inside its wait, send SIGTERM (to the trainers, the
    request they already have) and SIGKILL them 30 s later."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6}, checkpoint={"every": 1})
    run, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    process = _launch(config, run, stderr, "block@step:2")  # both ranks block in step 2, which cannot end
    wait_for(lambda: stderr.read_text().count("zaya fault: block at step 2") == 2, process, stderr, timeout=180)
    process.send_signal(signal.SIGINT)
    wait_for(lambda: INTERRUPT_SAID in stderr.read_text(), process, stderr, timeout=180)
    signalled = time.monotonic()
    process.send_signal(signal.SIGINT)
    _end(process, timeout=60)
    err = stderr.read_text()
    assert process.returncode == 130 and "SIGINT: passed on to the workers" in _one_line(err)
    assert err.count("zaya: aborted") == 2 and time.monotonic() - signalled < 30  # not torchrun's 30 s, then KILL
    assert committed_step(run) == 2


@pytest.mark.slow
def test_a_failed_worker_is_one_line_with_its_exit_code(tmp_path):
    command = [sys.executable, "-m", "zaya.cli", "launch", "--standalone", "--nproc-per-node", "1",
               "--monitor-interval", "0.2", "train", str(tmp_path / "missing.toml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "zaya: error:" in result.stderr
    assert "rank 0" in _one_line(result.stderr) and "exited with code 2" in _one_line(result.stderr)
