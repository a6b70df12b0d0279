"""`zaya convert` and exports against what a careless or hostile user has on disk: outputs are made in a staging
directory of the process's own and replace only an earlier output, never a link; Ctrl-C, SIGTERM and a full
disk leave no staging; every file of an HF directory is read as any input; errors name the output, never a
temporary path; a run whose newest checkpoint is damaged is exported from the one before, said in one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch

import zaya
from zaya import checkpoint as ckpt
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.owned import MARKER


@pytest.fixture(scope="module")
def sources(dataset, tmp_path_factory):
    """An HF export of a micro model with the dataset's tokenizer (and so its HF files), and a zaya checkpoint."""
    root = tmp_path_factory.mktemp("sources")
    model = zaya.build_model("micro", seed=0)
    zaya.export_hf(model, root / "hf", tokenizer=dataset / TOKENIZER_FILE)
    zaya.convert(root / "hf", root / "ckpt")
    return root / "hf", root / "ckpt"


def _one_line(cli, args, *fragments) -> str:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("zaya: error: "), (args, err)
    assert "Traceback" not in err and ".zaya-" not in err, err  # never a staging path
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if ".zaya-" in p.name)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_convert_touches_nothing_of_the_users_beside_its_output(sources, tmp_path, cli):
    _, checkpoint = sources
    out = tmp_path / "out"
    (tmp_path / "out.tmp").mkdir()  # a user's directories with names a careless clean-up would take
    (tmp_path / "out.tmp" / "notes.txt").write_text("mine")
    (tmp_path / ".out.zaya-notes").write_text("mine too")
    token = "0123456789ab"
    dead = tmp_path / f".out.zaya-{_dead_pid()}-{token}"  # what a killed convert into `out` left
    dead.mkdir()
    (dead / MARKER).write_text(json.dumps({"for": "out", "pid": int(dead.name.split("-")[-2]), "token": token,
                                           "host": socket.gethostname(), "what": "zaya export"}))
    (dead / "new").mkdir()
    assert cli("convert", checkpoint, out)[0] == 0
    assert not dead.exists()
    assert (tmp_path / "out.tmp" / "notes.txt").read_text() == "mine"
    assert (tmp_path / ".out.zaya-notes").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.zaya-notes", "out", "out.tmp"]


def test_overwrite_replaces_only_an_earlier_output_never_a_link(sources, tmp_path, cli):
    hf, checkpoint = sources
    other = tmp_path / "llama"
    shutil.copytree(hf, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    _one_line(cli, ["convert", checkpoint, other, "--overwrite"], f"{other}: neither an HF export nor a zaya")
    link = tmp_path / "link"
    link.symlink_to(hf)
    _one_line(cli, ["convert", checkpoint, link, "--overwrite"], f"{link}: a symbolic link")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "zaya.json").write_text(json.dumps({"format": "something else"}))
    (fake / ".metadata").write_bytes(b"")
    _one_line(cli, ["convert", hf, fake, "--overwrite"], f"{fake}: neither")
    assert (other / "model.safetensors").is_file() and link.is_symlink() and (hf / "config.json").is_file()
    assert (fake / "zaya.json").is_file() and _left_beside(tmp_path / "x") == []


def test_sigterm_during_a_convert_leaves_no_staging_and_the_old_output(sources, tmp_path, cli, monkeypatch):
    _, checkpoint = sources
    out = tmp_path / "out"
    assert cli("convert", checkpoint, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def terminated(directory, *args, **kwargs):
        assert (Path(directory).parent / MARKER).is_file(), "written inside a staging directory zaya marked"
        os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler raises Terminated here, in the main thread

    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("zaya.api.write_hf_files", terminated)
    try:
        for target, extra in ((out, ["--overwrite"]), (tmp_path / "new", [])):
            with pytest.raises(SystemExit) as ended:
                cli("convert", checkpoint, target, *extra)
            assert ended.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no staging, no half-written output"


def test_a_full_disk_or_a_refused_write_names_the_output(sources, tmp_path, cli, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    hf, checkpoint = sources

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    code, _, err = cli("convert", hf, tmp_path / "ckpt")
    assert code == 1
    assert err.strip() == f"zaya: error: no space left on device (ENOSPC) while writing {tmp_path / 'ckpt'}"
    monkeypatch.undo()

    def refused(directory, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(directory / "tokenizer_config.json"))

    monkeypatch.setattr("zaya.api.write_hf_files", refused)
    _one_line(cli, ["convert", checkpoint, tmp_path / "hf"],
              f"{tmp_path / 'hf' / 'tokenizer_config.json'}: cannot write (permission denied)")
    assert list(tmp_path.iterdir()) == []


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _edit(name: str, **changes):
    def edit(path: Path) -> None:
        file = path / name
        file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return edit


def _index(path: Path) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))


HF_FILES = {
    "config.json a FIFO": (lambda p: _fifo(p / "config.json"), "config.json: a FIFO, not a regular file"),
    "config.json from /dev/zero": (lambda p: ((p / "config.json").unlink(), (p / "config.json").symlink_to(
        "/dev/zero")), "config.json: a character device"),
    "config.json huge": (lambda p: (p / "config.json").write_text(" " * (5 << 20)), "larger than 4 MiB"),
    "config.json deep": (lambda p: (p / "config.json").write_text("[" * 10_000), "nested more than 64 deep"),
    "config.json a link loop": (lambda p: ((p / "config.json").unlink(), (p / "config.json").symlink_to(
        "config.json")), "config.json: cannot read (a loop of symbolic links)"),
    "layer_types not a list": (_edit("config.json", layer_types=5), "field 'layer_types' must be a list"),
    "a huge width": (_edit("config.json", hidden_size=10**400), "field 'hidden_size' must be an integer within"),
    "a huge initializer range": (_edit("config.json", initializer_range=10**400),
                                 "field 'initializer_range' must be a finite number, got an integer of about 401"),
    "a huge stack field": (_edit("config.json", zaya_stack={"temp_init": -(10**400)}),
                           "field 'temp_init' must be a finite number"),
    "generation_config.json a FIFO": (lambda p: _fifo(p / "generation_config.json"),
                                      "generation_config.json: a FIFO"),
    "chat_template.jinja a FIFO": (lambda p: _fifo(p / "chat_template.jinja"), "chat_template.jinja: a FIFO"),
    "an index of the wrong shape": (_index, "field 'weight_map' must be an object"),
    "model.safetensors a directory": (lambda p: ((p / "model.safetensors").unlink(),
                                                 (p / "model.safetensors").mkdir()),
                                      "model.safetensors: a directory; a weight file must be a safetensors file"),
}


@pytest.mark.parametrize("case", list(HF_FILES), ids=list(HF_FILES))
def test_every_file_of_an_hf_directory_is_read_as_an_input(sources, tmp_path, cli, case):
    hf, _ = sources
    copy = tmp_path / "hf"
    shutil.copytree(hf, copy)
    damage, match = HF_FILES[case]
    damage(copy)
    _one_line(cli, ["convert", copy, tmp_path / "out"], match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_names_too_long_and_link_loops_are_one_line(sources, tmp_path, cli):
    _, checkpoint = sources
    long = tmp_path / ("x" * 300)
    _one_line(cli, ["convert", checkpoint, long], "file name too long")
    _one_line(cli, ["convert", long, tmp_path / "out"], "file name too long")
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    _one_line(cli, ["convert", loop, tmp_path / "out"], "a loop of symbolic links")
    _one_line(cli, ["convert", checkpoint, loop, "--overwrite"], f"{loop}: a symbolic link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


def test_a_run_whose_newest_checkpoint_is_damaged_converts_the_one_before_and_says_so(sources, tmp_path, cli):
    _, checkpoint = sources
    model = zaya.load_model(checkpoint, device="cpu")
    root = tmp_path / "run" / "checkpoints"
    manager = ckpt.CheckpointManager(root, keep=3)
    info = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": model.config.to_dict(), "dtype": "float32"}
    for step in (1, 2):
        manager.save(step, {"model": model.state_dict()}, {"state": {}}, {**info, "step": step})
    (root / "step_00000002" / "zaya.json").write_text(json.dumps({**info, "step": 2, "world_size": 1}) + " ")
    code, out, err = cli("convert", tmp_path / "run", tmp_path / "hf")
    assert code == 0 and out.strip() == f"zaya->hf: wrote {tmp_path / 'hf'}"
    (line,) = err.splitlines()
    assert line.startswith(f"warning: using checkpoint {root / 'step_00000001'}, not the newest, step_00000002: "
                           f"step_00000002 is invalid ({root / 'step_00000002' / 'zaya.json'}: size ")
    assert not list(root.glob("*.bad")), "a command that only reads renames nothing"
    loaded = zaya.load_model(tmp_path / "hf", device="cpu")
    assert torch.equal(loaded.embed.weight, model.embed.weight)


TOKENIZER_CONFIGS = {
    "add_bos_token a string": ({"add_bos_token": "yes"}, "field 'add_bos_token' must be true or false, got 'yes'"),
    "bos_token a number": ({"bos_token": {"content": 5}}, "field 'bos_token.content' must be a string"),
    "add_eos_token a list": ({"add_eos_token": [1]}, "field 'add_eos_token' must be true or false, got a list"),
    "chat_template a number": ({"chat_template": 5}, "field 'chat_template' must be a string or a list"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CONFIGS), ids=list(TOKENIZER_CONFIGS))
def test_a_tokenizer_config_of_the_wrong_types_is_one_line_naming_the_key(sources, tmp_path, case):
    from zaya.data.tokenizer import load_tokenizer
    from zaya.errors import ZayaError
    from zaya.infer.hf_files import chat_template_of, special_tokens_of

    hf, _ = sources
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, tmp_path / name)
    path = tmp_path / "tokenizer_config.json"
    changes, match = TOKENIZER_CONFIGS[case]
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    read = chat_template_of if "chat_template" in changes else (
        lambda d: special_tokens_of(d, load_tokenizer(d / "tokenizer.json"), zaya.get_preset("micro")))
    with pytest.raises(ZayaError) as refused:
        read(tmp_path)
    assert str(refused.value).startswith(f"{path}: ") and match in str(refused.value), str(refused.value)
