"""Heartbeats: atomic per-rank files, timeouts calibrated from the ranks' own durations, the first to stop
named as the cause."""

import json
import os
import signal
import subprocess
import sys
import time

from zaya.resilience.command import WorkerCommand
from zaya.resilience.heartbeat import Heartbeat, HeartbeatSettings, HeartbeatWatcher, process_state


def test_inert_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a stray relative write would land
    beat = Heartbeat(None, 0)
    beat.beat("step", 3)
    beat("eval", 3)
    assert not beat.enabled and list(tmp_path.iterdir()) == []


def test_as_a_trainer_listener_it_beats_for_sections_only(tmp_path):
    beat = Heartbeat(tmp_path, 2)
    beat("step", 5)
    beat("committed", 5, tmp_path)  # a checkpoint event: no section
    beat("step-work", 5)  # inside the step: no section either
    record = json.loads((tmp_path / "rank-2.json").read_text())
    assert (record["section"], record["step"], record["rank"]) == ("step", 5, 2)


def test_the_timeout_follows_the_measured_step_time(tmp_path):
    settings = HeartbeatSettings(factor=2.0, floor_s=1.0, first_timeout_s=50.0, init_timeout_s=70.0)
    writer = Heartbeat(tmp_path, 0)
    writer.beat("init", 0)
    writer.beat("step", 0)
    watcher = HeartbeatWatcher(tmp_path, settings)
    now = time.time()
    assert watcher.poll(now + 49) is None and watcher.poll(now + 51).signal == "hang"  # first step: 50 s
    writer.beat("step", 1)
    time.sleep(0.3)
    writer.beat("step", 2)  # the longest recent step is now ~0.3 s: timeout = the floor of 1 s
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert record["section"] == "step" and record["step"] == 2 and 0.25 < record["longest"]["step"] < 1.0
    assert watcher.poll(record["time"] + 0.9) is None
    finding = watcher.poll(record["time"] + 1.2)
    assert finding.subject == "rank:0" and "floor" in finding.line and "running" in finding.line
    assert watcher.progress() == 2
    writer.beat("done", 2)
    assert watcher.poll(time.time() + 1e6) is None and watcher.finished(1)


def test_the_stopped_rank_is_named_not_the_ones_waiting_for_it(tmp_path):
    settings = HeartbeatSettings(factor=2.0, floor_s=0.1)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        for rank, pid in ((0, os.getpid()), (1, sleeper.pid)):
            (tmp_path / f"rank-{rank}.json").write_text(json.dumps(
                {"rank": rank, "pid": pid, "section": "step", "step": 5, "time": 100.0 + rank * 0.01,
                 "longest": {"step": 0.2}}))
        deadline = time.time() + 5
        while process_state(sleeper.pid) != "T" and time.time() < deadline:
            time.sleep(0.01)
        finding = HeartbeatWatcher(tmp_path, settings).poll(200.0)
        assert finding.subject == "rank:1" and "stopped" in finding.line and "[0]" in finding.detail
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_heartbeat_at_all_is_an_init_hang(tmp_path):
    watcher = HeartbeatWatcher(tmp_path / "none", HeartbeatSettings(init_timeout_s=10.0), started=0.0)
    assert watcher.poll(5.0) is None and "no rank wrote a heartbeat" in watcher.poll(11.0).line


def test_torchrun_commands_are_resized():
    command = WorkerCommand([sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node",
                             "8", "-m", "zaya.cli", "train", "x.toml"])
    assert command.torchrun and command.nproc_per_node() == 8 and command.nnodes() == (1, 2)
    resized = command.resized(7, 1)
    assert resized[3:6] == ["--nnodes=1:1", "--nproc_per_node", "7"] and resized[6:] == command.argv[6:]
    plain = WorkerCommand([sys.executable, "-m", "zaya.cli", "train", "x.toml"])
    assert not plain.torchrun and plain.resized(1, 1) == plain.argv
    # torchrun run by `zaya launch`: its options follow the two words that name it
    launched = WorkerCommand([sys.executable, "-m", "zaya.cli", "launch", "--nproc-per-node", "8", "train", "x.toml"])
    assert launched.torchrun and launched.nproc_per_node() == 8
    assert launched.resized(7, 1) == [*launched.argv[:4], "--nnodes", "1", "--nproc-per-node", "7", "train", "x.toml"]
