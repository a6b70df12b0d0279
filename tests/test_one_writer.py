"""One writer per directory: while a process holds a run directory or a dataset's output, a second `zaya train` or
`zaya data build` into it stops in one line naming the holder, and changes nothing; a holder that died (even by
SIGKILL) leaves no lock behind, and a build cleans up what killed builds left (only what their markers prove)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from runs import write_config
from zaya.locking import DirectoryLock, lock_path
from zaya.owned import Staging

HOLD = """
import sys, time
from zaya.locking import DirectoryLock
DirectoryLock(sys.argv[1], sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(directory: Path, what: str) -> subprocess.Popen:
    """Another process that takes the directory's lock and keeps it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), what], stdout=subprocess.PIPE, text=True,
                               env=env)
    assert process.stdout.readline().strip() == "held"
    return process


def _files(root: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


def test_a_second_trainer_on_a_run_directory_stops_in_one_line(dataset, tmp_path, cli):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 1, "eval_every": 0},
                          schedule={"warmup_steps": 0}, checkpoint={"every": 1, "keep": 1})
    run = tmp_path / "run"
    holder = _holder(run, "zaya train")
    try:
        code, _, err = cli("train", config, "--run-dir", run)
        assert code == 2 and "Traceback" not in err
        assert err.strip() == (f"zaya: error: {run}: in use by zaya train (pid {holder.pid} on host "
                               f"{socket.gethostname()}, since {err.split('since ')[1].split(')')[0]}); one process "
                               "writes a directory at a time")
        assert not run.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without a word: its lock went with it
    code, _, err = cli("train", config, "--run-dir", run)
    assert code == 0, err
    # and the finished run let go of its own
    DirectoryLock(run, "test").acquire().release()


def test_a_second_build_into_one_output_stops_and_a_build_cleans_up_after_killed_ones(tmp_path, cli):
    source = tmp_path / "a.txt"
    source.write_text("one two three four five six seven eight nine ten\n" * 50)
    out = tmp_path / "data"
    args = ["data", "build", "--input", source, "--out", out, "--vocab-size", "300", "--workers", "1",
            "--no-progress"]
    holder = _holder(out, "zaya data build")
    try:
        before = _files(tmp_path)
        code, _, err = cli(*args)
        assert code == 2 and f"{out}: in use by zaya data build (pid {holder.pid}" in err and len(err.splitlines()) == 1
        assert _files(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    killed = Staging(out, "zaya data build").__enter__()  # what a build killed by SIGKILL leaves: with its marker
    killed.path.mkdir()
    (killed.path / "train.00000.bin").write_bytes(b"\0" * 64)
    # named as staging directories were, but without a marker: not provably zaya's, so left alone
    unmarked = [tmp_path / ".data.partial-0123456789ab", tmp_path / ".data.old-xyz", tmp_path / ".other.zaya-1-ab"]
    for directory in unmarked:
        directory.mkdir()
    assert cli(*args)[0] == 0
    assert not killed.root.exists() and all(d.is_dir() for d in unmarked) and (out / "manifest.json").is_file()
    assert not lock_path(out).exists()  # let go, and removed


def test_the_same_process_shares_its_lock(tmp_path):
    first = DirectoryLock(tmp_path / "run", "a").acquire()
    second = DirectoryLock(tmp_path / "run", "b").acquire()  # a resume built in the same process
    first.release()
    other = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path / "run"), "x"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    assert other.returncode != 0 and "in use by a (pid" in other.stderr  # still held, by `second`
    second.release()
