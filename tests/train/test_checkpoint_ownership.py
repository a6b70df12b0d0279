"""Training checkpoints in a directory that may hold the user's own things: zaya removes or renames only the step
directories it can prove it made, reads `latest` as any input and falls back when it cannot, verifies that the
manifests account for every file, and leaves nothing half-written after a full disk."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from zaya import checkpoint as ckpt
from zaya.checkpoint.files import file_checksum
from zaya.errors import ZayaError, storage_error, storage_message

INFO = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": {}, "dtype": "float32"}


def _save(manager: ckpt.CheckpointManager, step: int, **options) -> Path:
    tensors = {"model": {"w": torch.arange(8.0) + step, "b": torch.ones(3)}}
    manager.save(step, tensors, {"state": {"step": step}}, {**INFO, "step": step}, **options)
    manager.wait()
    return manager.root / f"step_{step:08d}"


def _tree(root: Path) -> dict:
    return {p.relative_to(root): (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p)
                                  if p.is_symlink() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def root(tmp_path):
    return tmp_path / "checkpoints"


def _users(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    return path


def test_only_step_directories_zaya_made_are_removed_or_renamed(root):
    manager = ckpt.CheckpointManager(root, keep=1)
    users = [_users(root / name) for name in ("step_1", "step_00000000", "step_7.tmp", "step_00000009")]
    (root / "step_00000008").symlink_to(users[0])  # a link is never zaya's, whatever it points at
    killed = _save(manager, 2).with_name("step_00000005.tmp")
    killed.mkdir()
    ckpt.files.write_step_marker(killed)  # what a killed save leaves: zaya's marker, then some shards
    (killed / "__0_0.distcp").write_bytes(b"partial")
    (root / "step_00000006.tmp").mkdir()  # empty: left alone, and taken over by a save of step 6
    _save(manager, 3)
    _save(manager, 4)  # keep = 1: zaya's step 2 and 3 go, nobody else's directories do
    assert sorted(p.name for p in root.glob("step_0000000[234]")) == ["step_00000004"]
    before = _tree(root)
    lines = []
    manager.clean_uncommitted(log=lines.append)
    assert not killed.exists() and (root / "step_00000006.tmp").is_dir()
    assert lines == [f"{root / 'step_7.tmp'}: not a checkpoint zaya was writing; left as it is"]
    # training's look for a checkpoint, by directory order: a user's step_* is skipped and said, never renamed
    (root / "latest").unlink()
    lines = []
    assert manager.newest_valid(log=lines.append) == root / "step_00000004"
    assert [line.split(" is invalid")[0] for line in lines] == ["checkpoint step_00000009", "checkpoint step_00000008"]
    assert all(line.endswith("not a checkpoint zaya wrote, so left as it is; trying an older one") for line in lines)
    assert not list(root.glob("*.bad"))
    (root / "latest").write_text("step_00000004\n")
    assert {k: v for k, v in _tree(root).items() if not str(k).startswith("step_0000000")} == {
        k: v for k, v in before.items() if not str(k).startswith("step_0000000")}
    for user in users:
        assert (user / "thesis.tex").read_text() == "years of work"
    assert (root / "step_00000008").is_symlink()
    # what zaya made it still sets aside: a stale copy of a step saved again as .old, a damaged checkpoint as .bad
    _save(manager, 3)
    _save(manager, 3)  # as after a rollback
    assert (root / "step_00000003.old").is_dir() and (root / "latest").read_text() == "step_00000003\n"
    (root / "step_00000004" / "__0_0.distcp").write_bytes(b"garbage")
    (root / "latest").unlink()
    assert manager.newest_valid(log=lines.append) == root / "step_00000003"
    assert (root / "step_00000004.bad").is_dir() and not (root / "step_00000004").exists()
    _save(manager, 6)  # the empty directory of that name is written into, not removed first
    assert ckpt.is_zaya_checkpoint(root / "step_00000006") and not (root / "step_00000006.tmp").exists()


@pytest.mark.parametrize("name", ["step_00000002", "step_00000002.tmp"])
def test_a_save_where_something_else_stands_is_one_error_not_a_deletion(root, name):
    manager = ckpt.CheckpointManager(root, keep=3)
    _save(manager, 1)
    _users(root / name)
    before = _tree(root)
    with pytest.raises(ZayaError, match=f"{root / name}: exists and is not a checkpoint zaya"):
        _save(manager, 2)
    assert _tree(root) == before
    assert (root / "latest").read_text() == "step_00000001\n"


def test_the_pointer_is_written_through_no_link_and_replaces_only_zayas(root, tmp_path):
    manager = ckpt.CheckpointManager(root, keep=3)
    _save(manager, 1)
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (root / "latest.tmp").symlink_to(precious)  # the name the pointer was once written at
    _save(manager, 2)
    assert precious.read_text() == "mine" and (root / "latest.tmp").is_symlink()
    assert (root / "latest").read_text() == "step_00000002\n"
    (root / "latest").unlink()
    (root / "latest").symlink_to(precious)  # a link is nobody's pointer: refused, neither followed nor replaced
    before = _tree(root)
    with pytest.raises(ZayaError, match="latest: a symbolic link, not a pointer zaya wrote; refusing to replace it"):
        _save(manager, 3)
    assert _tree(root) == before and precious.read_text() == "mine"
    # a small file called latest where zaya has no checkpoint is the user's
    users = tmp_path / "users"
    users.mkdir()
    (users / "latest").write_text("my latest draft\n")
    with pytest.raises(ZayaError, match="latest: not a pointer zaya wrote, and no checkpoint of zaya's is beside it"):
        _save(ckpt.CheckpointManager(users, keep=3), 1)
    assert sorted(p.name for p in users.iterdir()) == ["latest"]


def _loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


POINTERS = {
    "not UTF-8": (lambda p: p.write_bytes(b"\xff\xfestep_00000001\n"), "not UTF-8 text"),
    "huge": (lambda p: p.write_text("step_00000001" + " " * 10_000), "larger than 4 KiB"),
    "a FIFO": (_fifo, "a FIFO, not a regular file"),
    "a link loop": (_loop, "a symbolic link"),
    "outside": (lambda p: p.write_text("../../etc\n"), "names '../../etc', not a checkpoint directory"),
    "gone": (lambda p: p.write_text("step_00000007\n"), "names step_00000007, which is not there"),
}


@pytest.mark.parametrize("case", list(POINTERS), ids=list(POINTERS))
def test_a_pointer_that_cannot_be_read_falls_back_to_directory_order_in_one_line(root, case, capsys):
    manager = ckpt.CheckpointManager(root, keep=3)
    _save(manager, 1)
    _save(manager, 2)
    damage, match = POINTERS[case]
    damage(root / "latest")
    lines = []
    assert manager.newest_valid(log=lines.append) == root / "step_00000002"  # training
    assert len(lines) == 1 and match in lines[0] and lines[0].endswith("by directory order"), lines
    assert ckpt.resolve_checkpoint(root.parent) == root / "step_00000002"  # a command that only reads
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {root / 'latest'}: ") and match in line and "step_00000002" in line
    if case in ("huge", "a FIFO", "a link loop"):  # not what a pointer of zaya's can be: not replaced either
        with pytest.raises(ZayaError, match="not a pointer zaya wrote; refusing to replace it"):
            _save(manager, 3)
        assert not (root / "step_00000003.tmp").exists()
        return
    _save(manager, 3)  # the next commit writes a good pointer
    assert (root / "latest").read_text() == "step_00000003\n"


def test_a_reader_says_in_one_line_which_older_checkpoint_it_took_and_why(root, capsys):
    manager = ckpt.CheckpointManager(root, keep=3)
    _save(manager, 1)
    for step in (2, 3):
        rng = _save(manager, step) / "rng.rank0.json"
        state = rng.read_bytes()
        rng.write_text("{}")
    before = _tree(root)
    assert ckpt.resolve_checkpoint(root.parent) == root / "step_00000001"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: using checkpoint {root / 'step_00000001'}, not the newest, step_00000003: "
                           f"step_00000003 is invalid ({root / 'step_00000003' / 'rng.rank0.json'}: size")
    assert line.endswith(", and 1 more newer one")
    assert _tree(root) == before  # readers rename nothing
    (root / "latest").write_text("step_00000001\n")
    rng.write_bytes(state)  # step 3 is whole again
    (root / "step_00000002").rename(root / "step_00000002.set-aside")
    assert ckpt.resolve_checkpoint(root.parent) == root / "step_00000001"
    assert capsys.readouterr().err.strip().endswith("not the newest, step_00000003: latest names it")
    (root / "latest").write_text("step_00000003\n")
    assert ckpt.resolve_checkpoint(root.parent) == root / "step_00000003"
    assert capsys.readouterr().err == ""  # the newest, as the pointer says: nothing to say


def _rewrite_manifest(checkpoint: Path, edit) -> None:
    path = checkpoint / "manifest.rank0.json"
    data = json.loads(path.read_text())
    edit(data["files"])
    path.write_text(json.dumps(data))


def _listed(checkpoint: Path, name: str) -> dict:
    return {"bytes": (checkpoint / name).stat().st_size, "crc32": file_checksum(checkpoint / name)}


COVERAGE = {
    "a weight file left out": (lambda c: _rewrite_manifest(c, lambda f: f.pop("__0_0.distcp")),
                               "__0_0.distcp: named by .metadata but not listed in any manifest"),
    "a weight file left out and gone": (
        lambda c: (_rewrite_manifest(c, lambda f: f.pop("__0_0.distcp")), (c / "__0_0.distcp").unlink()),
        "__0_0.distcp: named by .metadata but missing"),
    "train_state.json left out": (lambda c: _rewrite_manifest(c, lambda f: f.pop("train_state.json")),
                                  "train_state.json: not listed in any manifest"),
    "zaya.json left out": (lambda c: _rewrite_manifest(c, lambda f: f.pop("zaya.json")),
                           "zaya.json: not listed in any manifest"),
    "a file nobody wrote": (lambda c: (c / "notes.txt").write_text("x"), "notes.txt: not listed in any manifest"),
    "another rank's manifest": (lambda c: (c / "manifest.rank1.json").write_text("{}"),
                                "manifest.rank1.json: not listed in any manifest"),
    "a size of the wrong type": (lambda c: _rewrite_manifest(c, lambda f: f["zaya.json"].update(bytes="12")),
                                 "field 'files.zaya.json.bytes' must be an integer"),
    "a huge world size": (lambda c: (c / "zaya.json").write_text('{"world_size": 1' + "0" * 400 + "}"),
                          "field 'world_size' must be an integer in 1..1,048,576"),
    "a listed FIFO": (lambda c: (_rewrite_manifest(c, lambda f: f.update({"pipe": {"bytes": 0, "crc32": "0"}})),
                                 os.mkfifo(c / "pipe")), "pipe: a FIFO, not a regular file"),
    "a listed link loop": (lambda c: (_rewrite_manifest(c, lambda f: f.update({"loop": {"bytes": 0, "crc32": "0"}})),
                                      (c / "loop").symlink_to("loop")), "loop: cannot read (a loop of symbolic links)"),
    "a manifest as a FIFO": (lambda c: ((c / "manifest.rank0.json").unlink(), os.mkfifo(c / "manifest.rank0.json")),
                             "manifest.rank0.json: a FIFO"),
    "zaya.json from /dev/zero": (lambda c: ((c / "zaya.json").unlink(), (c / "zaya.json").symlink_to("/dev/zero")),
                                 "zaya.json: a character device"),
    "a deep manifest": (lambda c: (c / "manifest.rank0.json").write_text("[" * 5000 + "]" * 5000),
                        "nested more than 64 deep"),
}


@pytest.mark.parametrize("case", list(COVERAGE), ids=list(COVERAGE))
def test_the_manifests_must_account_for_every_file(root, case):
    checkpoint = _save(ckpt.CheckpointManager(root, keep=3), 1)
    ckpt.verify_checkpoint(checkpoint)
    damage, match = COVERAGE[case]
    damage(checkpoint)
    with pytest.raises(ZayaError) as refused:
        ckpt.verify_checkpoint(checkpoint)
    assert match in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(root, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    manager = ckpt.CheckpointManager(root, keep=3)
    _save(manager, 1)
    before = _tree(root)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    for async_save in (False, True):
        with pytest.raises(OSError) as raised:  # DCP's CheckpointException (a BaseException) becomes this
            _save(manager, 2, async_save=async_save)
        assert storage_message(storage_error(raised.value)) == (
            f"no space left on device (ENOSPC) while writing {root / 'step_00000002'}")
        assert _tree(root) == before, "the partial checkpoint is gone, the last one and latest are as they were"
    monkeypatch.undo()
    assert _save(manager, 2) == ckpt.resolve_checkpoint(root)


def _save_beside_a_users_step(rank: int, world_size: int, root: str) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the pool has set each rank's environment
    try:
        manager = ckpt.CheckpointManager(Path(root), keep=2, rank=rank, world_size=world_size,
                                         control_group=dist.new_group(backend="gloo"))
        _save(manager, 3)
    except ZayaError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "saved"


def test_a_refused_save_stops_every_rank_not_only_rank_0(root):
    from ranks import run_distributed

    _users(root / "step_00000003")  # where the save must write: rank 0 refuses, the others must hear of it
    before = _tree(root)
    results = run_distributed(_save_beside_a_users_step, 2, str(root), timeout=60)
    assert results[0] == results[1] and "not a checkpoint zaya wrote" in results[0]
    assert _tree(root) == before
