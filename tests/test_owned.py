"""zaya destroys only what it can prove it made (`zaya.owned`, `zaya.locking`): outputs are made in staging
directories of its own and renamed into place; leftovers are removed only when their marker says zaya made them
for that output; a file output replaces only a regular file, and only when asked; a lock file planted as a link,
a hard link or a file of someone else's is refused; SIGTERM unwinds like Ctrl-C so a command cleans up after
itself; click's usage errors keep click's message and exit code."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zaya import owned
from zaya.errors import ZayaError
from zaya.locking import DirectoryLock, lock_path


def _tree(root: Path) -> dict:
    """Every path under `root` with what it is and holds: what a test compares before and after."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[path] = ("link", os.readlink(path))
        elif path.is_file():
            found[path] = ("file", path.read_bytes())
        else:
            found[path] = ("dir" if path.is_dir() else "other", None)
    return found


def test_an_output_appears_whole_or_not_at_all_and_only_its_staging_goes(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "out.tmp").mkdir()  # a user's directories with names a careless clean-up would take
    (tmp_path / ".out.partial-1").mkdir()
    (tmp_path / ".out.zaya-1-abcdef").mkdir()
    before = _tree(tmp_path)
    with pytest.raises(RuntimeError), owned.Staging(out, "test") as staging:
        staging.path.mkdir()
        (staging.path / "half").write_text("x")
        raise RuntimeError("the writer failed")
    assert _tree(tmp_path) == before
    with owned.Staging(out, "test") as staging:
        staging.path.mkdir()
        (staging.path / "a").write_text("1")
        staging.commit()
    assert _tree(tmp_path) == {**before, out: ("dir", None), out / "a": ("file", b"1")}
    with owned.Staging(out, "test") as staging:
        staging.path.mkdir()
        (staging.path / "b").write_text("2")
        with pytest.raises(ZayaError, match="out: already exists; refusing to overwrite"):
            staging.commit()
        staging.commit(replace=True)
    assert _tree(tmp_path) == {**before, out: ("dir", None), out / "b": ("file", b"2")}


def test_leftovers_are_removed_only_with_zaya_marker_for_that_output(tmp_path):
    out = tmp_path / "data"
    killed = owned.Staging(out, "zaya data build").__enter__()  # as a process killed mid-write leaves it
    killed.path.mkdir()
    other = owned.Staging(tmp_path / "other", "zaya data build").__enter__()
    forged = tmp_path / f".data.zaya-{os.getpid()}-0123456789ab"  # the name without the marker
    forged.mkdir()
    wrong = tmp_path / ".data.zaya-99999999-feedfacecafe"
    wrong.mkdir()
    (wrong / owned.MARKER).write_text('{"for": "data", "pid": 99999999, "token": "other"}')  # token not its name's
    # this process is alive: without the lock its staging is not stale
    assert owned.remove_stale_staging(out, locked=False) == []
    assert owned.remove_stale_staging(out, locked=True) == [killed.root]
    assert not killed.root.exists() and other.root.exists() and forged.is_dir() and wrong.is_dir()


def test_a_swap_cut_short_gives_the_old_output_back(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "weights").write_text("old")
    staging = owned.Staging(out, "zaya convert").__enter__()
    staging.path.mkdir()
    os.rename(out, staging.root / "replaced")  # killed between the swap's two renames: no `out` at all
    assert owned.remove_stale_staging(out, locked=True) == [staging.root]
    assert (out / "weights").read_text() == "old" and not staging.root.exists()


def test_a_long_output_name_still_gets_a_staging_directory(tmp_path):
    out = tmp_path / ("n" * 250)
    with owned.Staging(out, "test") as staging:
        staging.path.mkdir()
        staging.commit()
    assert out.is_dir() and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_file_output_replaces_only_a_regular_file_and_only_when_asked(tmp_path):
    target = tmp_path / "table.json"
    owned.write_output(target, "one", overwrite=False)
    with pytest.raises(ZayaError, match=r"table\.json: already exists; pass --overwrite to replace it"):
        owned.write_output(target, "two", overwrite=False)
    owned.write_output(target, "two", overwrite=True)
    assert target.read_text() == "two"
    fifo, link, victim = tmp_path / "fifo", tmp_path / "link", tmp_path / "victim"
    os.mkfifo(fifo)
    victim.write_text("keep")
    link.symlink_to(victim)
    before = _tree(tmp_path)
    for path, words in ((fifo, "not a regular file"), (link, "a symbolic link"), (tmp_path, "not a regular file"),
                        (Path("/dev/null"), "not a regular file")):
        with pytest.raises(ZayaError) as caught:
            owned.write_output(path, "x", overwrite=True)
        assert str(caught.value) == f"{path}: exists and is {words}; refusing to replace it"
    with pytest.raises(ZayaError, match="file name too long"):
        owned.write_output(tmp_path / ("x" * 300), "x", overwrite=False)
    with pytest.raises(ZayaError, match=r"^/nonexistent/dir/out\.json: cannot write \(no such file or directory\)$"):
        owned.write_output(Path("/nonexistent/dir/out.json"), "x", overwrite=False)
    assert _tree(tmp_path) == before  # no temporary file left either


@pytest.mark.parametrize("planted", ["symlink", "user file", "hard link", "fifo"])
def test_a_lock_path_that_is_not_zaya_lock_file_is_refused_untouched(tmp_path, planted):
    run = tmp_path / "run"
    path = lock_path(run)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    if planted == "symlink":
        path.symlink_to(victim)
    elif planted == "user file":
        path.write_text("not a lock\n")
    elif planted == "hard link":
        os.link(victim, path)
    else:
        os.mkfifo(path)
    before = _tree(tmp_path)
    with pytest.raises(ZayaError) as caught:
        DirectoryLock(run, "zaya train").acquire()
    assert str(caught.value).startswith(f"{path.absolute()}: ") and "refusing" in str(caught.value)
    assert _tree(tmp_path) == before


def test_a_killed_holders_lock_file_is_taken_over(tmp_path):
    run = tmp_path / "run"
    path = lock_path(run)
    path.write_text('{"pid": 1, "host": "node", "what": "zaya train", "since": "then"}\n')  # the kernel let go
    lock = DirectoryLock(run, "zaya train").acquire()
    assert f'"pid": {os.getpid()}' in path.read_text()
    lock.release()
    assert not path.exists()


CLEANS_UP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from zaya.locking import DirectoryLock
    from zaya.owned import Staging, interrupt_on_sigterm
    interrupt_on_sigterm()
    out = Path(sys.argv[1])
    with DirectoryLock(out, "test"), Staging(out, "test") as staging:
        staging.path.mkdir()
        print("writing", flush=True)
        time.sleep(60)
""")


def test_sigterm_unwinds_so_a_command_removes_its_staging_and_lock(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", CLEANS_UP, str(out)], stdout=subprocess.PIPE, text=True,
                               env=env, stderr=subprocess.PIPE)
    assert process.stdout.readline() == "writing\n"
    assert len(list(tmp_path.iterdir())) == 2  # the staging directory and the lock file
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    assert "Traceback" not in process.stderr.read()


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "m", "--max-new-tokens", "-1"], "Invalid value for '--max-new-tokens'"),
    (["convert", "a", "b", "--layout", "bogus"], "Invalid value for '--layout'"),
    (["params"], "Missing argument 'MODEL'"),
    (["train", "c.toml", "--no-such-flag"], "No such option '--no-such-flag'"),
    (["no-such-command"], "No such command 'no-such-command'"),
])
def test_click_usage_errors_keep_click_message_and_exit_2(cli, args, message):
    code, _, err = cli(*args)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("Usage: zaya ") and f"Error: {message}" in err


@pytest.mark.parametrize(("error", "wrapped", "line"), [
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "runs/x"), False, "runs/x: a loop of symbolic links"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "runs/y"), False, "runs/y: file name too long"),
    (OSError(errno.ENOSPC, "No space left on device", "runs/z"), True,
     "no space left on device (ENOSPC) while writing runs/z"),
])
def test_an_os_error_on_a_path_is_one_line(cli, tmp_path, monkeypatch, error, wrapped, line):
    import zaya.report.report

    def fails(_run_dir):
        if wrapped:  # a storage error counts at any depth
            raise RuntimeError("the report failed") from error
        raise error

    monkeypatch.setattr(zaya.report.report, "read_all_incidents", fails)
    code, _, err = cli("report", tmp_path)
    assert (code, err) == (1 if wrapped else 2, f"zaya: error: {line}\n")
