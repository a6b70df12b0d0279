"""A corpus of bad inputs: each is one line on stderr, a non-zero exit, no traceback, and a command that only reads
changes no file. The cases follow the hardening probe's findings (non-finite and out-of-range config values,
unbounded sizes, devices, paths of the wrong kind, garbled files, damaged checkpoints)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from runs import write_config
from zaya.config import load_config
from zaya.resilience.diagnose import classify_lines
from zaya.training import build_trainer


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """A config and the run it trained (four steps of `micro`, checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("bad")
    config = write_config(root / "run.toml", dataset, train={"max_steps": 4, "eval_every": 0},
                          checkpoint={"every": 2, "keep": 2}, schedule={"warmup_steps": 1})
    build_trainer(load_config(config), root / "run").run()
    return config, root / "run"


def _snapshot(root: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.stat().st_size < 1 << 16 else None)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(cli, args, match: str) -> None:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code != 0, args
    assert len(lines) == 1 and lines[0].startswith("zaya: error: "), (args, err)
    assert "Traceback" not in err
    assert match in lines[0], (match, lines[0])


CONFIG_VALUES = [
    ("balance.ki=nan", "key 'balance.ki' must be a finite number, got nan"),
    ("balance.kp=inf", "key 'balance.kp' must be a finite number, got inf"),
    ("balance.kd=-0.5", "key 'balance.kd' must be a number in [0, 100], got -0.5"),
    ("train.grad_clip=nan", "key 'train.grad_clip' must be a finite number"),
    ("train.max_time_s=nan", "key 'train.max_time_s' must be a finite number"),
    ("train.time_budget_s=inf", "key 'train.time_budget_s' must be a finite number"),
    ("data.ramp_start=-3", "key 'data.ramp_start' must be an integer in 0..16,777,216, got -3"),
    ("train.seed=-1", "key 'train.seed' must be an integer in 0..9,223,372,036,854,775,807, got -1"),
    ("optim.lr=nan", "key 'optim.lr' must be a finite number"),
    ("train.micro_batch_size=100000000", "key 'train.micro_batch_size' must be an integer in 1..65,536, got 100000000"),
    ("model.num_hidden_layers=10000000", "field 'num_hidden_layers' = 10,000,000 is above the bound 4,096"),
    ("model.vocab_size=1000000000000", "field 'vocab_size' = 1,000,000,000,000 is above the bound"),
    ("model.num_attention_heads=0", "field 'num_attention_heads' must be a positive integer, got 0"),
    ("model.head_dim=2147483648", "field 'head_dim' = 2,147,483,648 is above the bound 4,096"),
    ("model.rope_theta=nan", "field 'rope_theta' must be a finite number, got nan"),
]


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize(("override", "match"), CONFIG_VALUES, ids=[o for o, _ in CONFIG_VALUES])
def test_config_values_that_cannot_train_are_one_line(trained, cli, tmp_path, command, override, match):
    config, _ = trained
    args = [command, config, "--set", override]
    _one_line(cli, args + (["--run-dir", tmp_path / "run"] if command == "train" else []), match)
    assert not (tmp_path / "run").exists()


def test_a_model_directory_with_unbounded_sizes_is_one_line(trained, cli, tmp_path):
    hf = tmp_path / "hf"
    assert cli("convert", trained[1], hf)[0] == 0
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10_000_000}))
    before = _snapshot(hf)
    _one_line(cli, ["params", hf], "is above the bound 4,096")
    _one_line(cli, ["generate", "--model", hf, "--prompt-ids", "5"], "is above the bound 4,096")
    assert _snapshot(hf) == before


def test_devices_this_machine_does_not_have_are_one_line(trained, cli):
    _, run = trained
    before = _snapshot(run)
    _one_line(cli, ["generate", "--model", run, "--device", "bogus", "--prompt-ids", "5,6"],
              "device 'bogus': not a device name")
    _one_line(cli, ["generate", "--model", run, "--device", "cuda:3", "--prompt-ids", "5,6"], "device 'cuda:3'")
    assert _snapshot(run) == before


def test_paths_of_the_wrong_kind_are_one_line(trained, cli, tmp_path):
    config, _ = trained
    _one_line(cli, ["train", tmp_path, "--run-dir", tmp_path / "r"], "a directory, not a regular file")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line(cli, ["train", config, "--run-dir", afile], f"{afile}: the run directory is a file")
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 3)
    _one_line(cli, ["plan", config, "--device", "local", "--table", garbage], "garbage.bin: not ")
    binary = tmp_path / "binary_run"
    binary.mkdir()
    (binary / "metrics.jsonl").write_bytes(b"\x00\x01binary\xff\n")
    _one_line(cli, ["report", binary], "metrics.jsonl: not a metrics log")


def _damaged_copy(run: Path, tmp_path: Path, damage) -> Path:
    """A copy of the run with its one checkpoint (the newest) damaged."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000002")
    damage(copy / "checkpoints" / "step_00000004")
    return copy


def _flip_bytes(checkpoint: Path) -> None:
    shard = max((p for p in checkpoint.glob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    for i in range(16):
        data[len(data) // 2 + i] ^= 0xFF
    shard.write_bytes(bytes(data))


def _edit_json(name: str, edit):
    def damage(checkpoint: Path) -> None:
        path = checkpoint / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return damage


def _outside_path(data: dict) -> None:
    name = next(iter(data["files"]))
    data["files"]["../../outside"] = data["files"].pop(name)


DAMAGE = {
    "flipped bytes": (_flip_bytes, "checksum does not match manifest.rank0.json"),
    "a string world size": (_edit_json("zaya.json", lambda d: d.update(world_size="2")),
                            "field 'world_size' must be an integer"),
    "a zero world size": (_edit_json("zaya.json", lambda d: d.update(world_size=0)),
                          "field 'world_size' must be an integer"),
    "a path outside": (_edit_json("manifest.rank0.json", _outside_path), "a path outside the checkpoint"),
    "deep nesting": (lambda c: (c / "zaya.json").write_text("[" * 100_000), "not valid JSON (nested"),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_readers_refuse_a_damaged_checkpoint_and_change_nothing(trained, cli, tmp_path, damage):
    _, run = trained
    damage_fn, match = DAMAGE[damage]
    copy = _damaged_copy(run, tmp_path, damage_fn)
    (checkpoint,) = (copy / "checkpoints").glob("step_*")
    before = _snapshot(copy)
    _one_line(cli, ["convert", checkpoint, tmp_path / "hf"], match)
    _one_line(cli, ["generate", "--model", checkpoint, "--prompt-ids", "5,6", "--max-new-tokens", "2"], match)
    # given the run, a reader finds no valid checkpoint and renames nothing
    _one_line(cli, ["convert", copy, tmp_path / "hf"], "no valid checkpoint")
    _one_line(cli, ["generate", "--model", copy, "--prompt-ids", "5,6", "--max-new-tokens", "2"],
              "no valid checkpoint")
    assert _snapshot(copy) == before and not (tmp_path / "hf").exists()


def test_a_dataset_manifest_nested_too_deeply_is_one_line(dataset, tmp_path, cli):
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    (copy / "manifest.json").write_text("[" * 100_000)
    before = _snapshot(copy)
    _one_line(cli, ["data", "inspect", copy], "manifest.json: not a readable manifest (nested too deeply)")
    assert _snapshot(copy) == before


def test_token_ids_above_what_the_manifest_promises_are_refused_with_the_shard_and_position(dataset, tmp_path):
    from zaya.data.loader import TokenLoader
    from zaya.errors import ZayaError

    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = copy / manifest["splits"]["train"]["shards"][0]["file"]
    tokens = bytearray(shard.read_bytes())
    itemsize = {"uint16": 2, "uint32": 4}[manifest["dtype"]]
    tokens[5 * itemsize:6 * itemsize] = (65_535).to_bytes(itemsize, "little")  # position 5: far above the vocabulary
    shard.write_bytes(bytes(tokens))  # the manifest still promises its max_token_id (its checksum now lies too)
    with TokenLoader([(copy, 1.0)], 32, seed=0, block_size=1) as loader, pytest.raises(ZayaError) as error:
        for _ in range(200):
            loader.next_batch(64)
    assert str(error.value).startswith(f"{shard}: token id 65535 at position 5 is above the manifest's max_token_id")


def _small_disk(path: Path) -> bool:
    """A 256 kB tmpfs at `path`, where this machine lets us mount one (root, no container rule against it)."""
    path.mkdir()
    return shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True).returncode == 0


def _big_text(path: Path) -> Path:
    words = [f"{w}{i}" for i in range(400) for w in ("alpha", "beta", "gamma", "delta")]
    path.write_text("\n\n".join(" ".join(words[(d * 7 + k) % len(words)] for k in range(200))
                                for d in range(1000)))  # 1.7 MB of text: more tokens than 256 kB hold
    return path


def _storage_line(code: int, err: str, expected: str) -> None:
    assert code == 1 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(expected), line
    assert classify_lines([line]).root == "storage"


def test_a_full_disk_is_one_line_that_names_it_and_diagnoses_as_storage(tmp_path, cli):
    disk = tmp_path / "disk"
    if not _small_disk(disk):
        pytest.skip("no tmpfs can be mounted here; the simulated case below covers the message")
    try:
        code, _, err = cli("data", "build", "--input", _big_text(tmp_path / "big.txt"), "--out", disk / "data",
                           "--vocab-size", "300", "--workers", "1", "--no-progress")
        assert not any(disk.iterdir())  # nothing half-written, not even the lock
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    _storage_line(code, err, "zaya: error: no space left on device (ENOSPC)")


def test_a_storage_error_deep_in_a_failure_is_the_line(tmp_path, cli, monkeypatch):
    # simulated: the disk's error raised where the builder writes, under a wrapper of its own
    import errno

    import zaya.data_cli as data_cli

    target = tmp_path / "data" / "train.00000.bin"

    def full(*_args, **_kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        except OSError as exc:
            raise RuntimeError("the build failed") from exc

    monkeypatch.setattr(data_cli, "build_dataset", full)
    code, _, err = cli("data", "build", "--input", _big_text(tmp_path / "big.txt"), "--out", tmp_path / "data",
                       "--no-progress")
    _storage_line(code, err, f"zaya: error: no space left on device (ENOSPC) while writing {target}")


def test_ranks_that_read_other_data_disagree_on_its_fingerprint(dataset, tmp_path):
    from zaya.data.build import BuildOptions, build_dataset
    from zaya.train.inputs import check_inputs, disagreement, run_settings

    source = tmp_path / "other.txt"
    source.write_text("other words entirely\n" * 300)
    other = tmp_path / "other"
    build_dataset(BuildOptions(inputs=(str(source),), out=other, vocab_size=300, val_fraction=0.1, workers=1))
    runs = [load_config(write_config(tmp_path / f"{n}.toml", path)).resolve(2, "fp32")
            for n, path in (("a", dataset), ("b", other))]
    settings = [run_settings(run, check_inputs(run, None)[1]) for run in runs]
    for flat in settings:  # the same path on both ranks, mounted to other data on rank 1
        flat["config.data.path"] = "data/shared"
        flat["config.phases.0.sources.0.path"] = "data/shared"
    message = disagreement(settings)
    assert message.startswith("the ranks disagree on data.main: ['") and message.endswith(
        "'] on rank 1; every rank needs the same config and data")
    assert disagreement([settings[0], settings[0], {**settings[0], "config.train.seed": 7}]).startswith(
        "the ranks disagree on config.train.seed: 3 on rank 0, 7 on rank 2")


def _rewrite_keeping_the_checksums(checkpoint: Path, name: str, edit) -> None:
    """Change one of a checkpoint's files and record its new size and checksum, as if it had been written so."""
    from zaya.checkpoint.files import file_checksum

    path = checkpoint / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    manifest = checkpoint / "manifest.rank0.json"
    data = json.loads(manifest.read_text())
    data["files"][name] = {"bytes": path.stat().st_size, "crc32": file_checksum(path)}
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize(("name", "edit", "field"), [
    ("train_state.json", lambda d: {**d, "state": {**d["state"], "step": "four"}},
     "field 'state.step' must be an integer in 0.."),
    ("rng.rank0.json", lambda d: {**d, "python": [3, "x", None]}, "not a random-number generator state"),
], ids=["state", "rng"])
def test_a_checkpoint_that_verifies_but_cannot_be_resumed_is_set_aside(trained, tmp_path, name, edit, field):
    from zaya.checkpoint import verify_checkpoint

    config, trained_run = trained
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step_00000004"
    _rewrite_keeping_the_checksums(newest, name, edit)
    verify_checkpoint(newest)  # its files match their manifest
    trainer = build_trainer(load_config(config, ["train.max_steps=5", "schedule.total_steps=5"]), run)
    assert trainer.setup.resume_from == run / "checkpoints" / "step_00000002"
    assert (run / "checkpoints" / "step_00000004.bad").is_dir() and not newest.exists()
    log = (run / "train.log").read_text()
    assert f"checkpoint step_00000004 is invalid ({newest / name}: {field}" in log
    trainer.setup.lock.release()


def test_only_regular_files_are_read_as_inputs(tmp_path, cli):
    import os

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.txt").write_text("plain words to read and tokenize\n" * 20)
    os.mkfifo(inputs / "b.txt")  # opening it for reading would wait for a writer forever
    code, out, err = cli("data", "build", "--input", inputs, "--out", tmp_path / "data", "--vocab-size", "300",
                         "--workers", "1", "--no-progress")
    assert code == 0, err
    assert "1 files" in out
    _one_line(cli, ["data", "build", "--input", inputs / "b.txt", "--out", tmp_path / "other", "--no-progress"],
              "b.txt: not a regular file")


def test_an_output_that_cannot_be_written_is_one_line(trained, tmp_path, cli):
    # a path under a regular file: no directory can be made there, whoever runs the command (root too)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    source = tmp_path / "text.txt"
    source.write_text("words to build a dataset from\n" * 20)
    _one_line(cli, ["data", "build", "--input", source, "--out", blocker / "data", "--vocab-size", "300",
                    "--no-progress"], str(blocker))
    _one_line(cli, ["convert", trained[1], blocker / "hf"], str(blocker))
    _one_line(cli, ["train", trained[0], "--run-dir", blocker / "run"], str(blocker))
    assert blocker.read_text() == "x"


def test_an_empty_run_dir_is_refused(trained, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line(cli, ["train", trained[0], "--run-dir", ""], "--run-dir '': empty")
    assert list(tmp_path.iterdir()) == []
