"""`zaya train`: exact resume after SIGKILL, crash-safe checkpoints, phases, the ramp, bad input.

One test kills a real `zaya train` process; the others crash it in this process (an injected exception at the
same point), which leaves the run directory as a kill would."""

import json
import os
import pickle
import random
import signal
import sys
from pathlib import Path

import pytest
import torch

from ranks import run_command
from runs import assert_same_run, build_code_dataset, losses, write_config, zaya_command
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.resilience.faults import InjectedFault
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def _crash(config: Path, run_dir: Path, fault: str) -> None:
    """Train in this process until the injected `raise` fault stops it, as a crash would."""
    with pytest.raises(InjectedFault):
        build_trainer(load_config(config), run_dir, environ={"ZAYA_FAULTS": fault}).run()


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_bitwise_identical(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset)
    build_trainer(load_config(config), tmp_path / "straight").run()

    kill_at = random.Random(0).randint(4, 8)  # after the checkpoint of step 3 or 6
    command = [sys.executable, "-m", "zaya.cli", "train", config, "--run-dir", tmp_path / "resumed"]
    crashed = run_command(command, env={"ZAYA_FAULTS": f"sigkill@step:{kill_at}"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert max(r["step"] for r in read_metrics(tmp_path / "resumed")) == kill_at
    build_trainer(load_config(config), tmp_path / "resumed").run()  # what the killed process left, resumed
    assert "resumed from" in (tmp_path / "resumed" / "train.log").read_text()
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")


def test_a_crash_in_bf16_then_resume_is_bitwise_identical(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"precision": "bf16", "max_steps": 6})
    build_trainer(load_config(config), tmp_path / "straight").run()
    _crash(config, tmp_path / "resumed", "raise@step:4")
    assert max(r["step"] for r in read_metrics(tmp_path / "resumed")) == 4
    build_trainer(load_config(config), tmp_path / "resumed").run()
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")


def test_a_crash_during_a_checkpoint_write_keeps_the_previous_one(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 8})
    _crash(config, tmp_path / "run", "raise@checkpoint-written:6")
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert (root / "step_00000006.tmp").is_dir() and not (root / "step_00000006").exists()
    assert ckpt.resolve_checkpoint(tmp_path / "run").name == "step_00000003"
    build_trainer(load_config(config), tmp_path / "run").run()
    assert not (root / "step_00000006.tmp").exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006", "step_00000008"]


def test_damaged_shards_are_detected_and_the_newest_valid_checkpoint_used(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 9},
                                      checkpoint={"keep": 3}))
    build_trainer(config, tmp_path / "run").run()
    root = tmp_path / "run" / "checkpoints"
    for step, damage in ((9, "truncate"), (6, "flip")):
        shard = next((root / f"step_{step:08d}").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 3] ^= 0x10
        shard.write_bytes(bytes(data))
    trainer = build_trainer(load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 10},
                                                     checkpoint={"keep": 3})), tmp_path / "run")
    assert trainer.resume_from.name == "step_00000003"
    for step in (6, 9):  # kept aside, never deleted
        assert (root / f"step_{step:08d}.bad").is_dir()
    trainer.run()
    assert trainer.progress.step == 10


def test_phases_switch_at_their_token_budgets_and_the_ramp_continues_across_resume(dataset, tmp_path):
    phases = [
        {"name": "first", "tokens": 1024, "seq_len": 32},
        {"name": "second", "tokens": 0, "seq_len": 16, "rope_theta": 50000.0, "lr_scale": 0.5},
    ]
    config = write_config(tmp_path / "run.toml", dataset, phases=phases,
                          data={"ramp_start": 4, "ramp_increment": 4, "ramp_samples": 16},
                          train={"max_steps": 9}, checkpoint={"every": 4})
    build_trainer(load_config(config), tmp_path / "straight").run()
    rows = read_metrics(tmp_path / "straight")
    batches = [r["batch_size"] for r in rows]
    assert batches == [4, 4, 4, 4, 8, 8, 8, 8, 8]
    # 1024 tokens of seq_len 32: the step whose tokens reach the budget is the last of phase one
    switch = next(r["step"] for r in rows if r["phase"] == "second")
    assert sum(r["batch_size"] * 32 for r in rows if r["step"] < switch) >= 1024
    assert sum(r["batch_size"] * 32 for r in rows if r["step"] < switch - 1) < 1024

    # interrupted at step 6 and resumed: the same ramp and phases, the same losses
    _crash(config, tmp_path / "resumed", "raise@step:6")
    build_trainer(load_config(config), tmp_path / "resumed").run()
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    resumed_rows = read_metrics(tmp_path / "resumed")
    assert [r["batch_size"] for r in resumed_rows] == batches
    state = json.loads((ckpt.resolve_checkpoint(tmp_path / "resumed") / "train_state.json").read_text())
    assert state["state"]["phase"] == 1


def test_controller_state_survives_resume(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6},
                                      balance={"ki": 0.01}))
    trainer = build_trainer(config, tmp_path / "run")
    trainer.run()
    biases = [b.moe.router.balancing_biases.clone() for b in trainer.model.blocks]
    assert any(torch.any(b[:-1] != 0) for b in biases) and all(b[-1] == -1 for b in biases)
    again = build_trainer(config, tmp_path / "run")
    again._build()
    try:
        for block, expected in zip(again.model.blocks, biases, strict=True):
            assert torch.equal(block.moe.router.balancing_biases, expected)
        assert again.controller.state.steps == 6
        assert torch.equal(again.controller.state.integral, trainer.controller.state.integral)
    finally:
        again.parallel.close()


def _assert_refused(result, *fragments):
    code, _, err = result
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zaya: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


def _train(config: Path, run_dir: Path, *args: str):
    return zaya_command(["train", config, "--run-dir", run_dir, *args])


def test_bad_input_is_refused_with_one_line_and_nothing_written(dataset, tmp_path):
    run = tmp_path / "run"
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 3\n")
    _assert_refused(_train(bad, run), "bad.toml", "TOML")
    _assert_refused(_train(write_config(bad, dataset, train={"max_stepz": 3}), run), "train.max_stepz")
    _assert_refused(_train(write_config(bad, dataset, train={"max_steps": "many"}), run), "train.max_steps")
    _assert_refused(_train(write_config(bad, dataset, model={"preset": "huge"}), run), "model.preset", "huge")
    _assert_refused(_train(write_config(bad, tmp_path / "nowhere"), run), "nowhere")
    _assert_refused(_train(write_config(bad, dataset, data={"block_size": 0}), run), "data.block_size", "1..16,777,216")
    assert not run.exists()


def test_the_sample_orders_blocks_are_the_configs(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2},
                          data={"block_size": 1, "group_blocks": 8})
    build_trainer(load_config(config), tmp_path / "run").run()
    state = ckpt.read_json(ckpt.resolve_checkpoint(tmp_path / "run") / ckpt.TRAIN_STATE_FILE)["state"]
    (loader,) = state["loaders"].values()
    assert (loader["block_size"], loader["group_blocks"]) == (1, 8)
    # the loader's state names its order: resuming with other blocks is a changed dataset
    other = write_config(tmp_path / "other.toml", dataset, train={"max_steps": 3})
    _assert_refused(_train(other, tmp_path / "run"), "'block_size' is 1", "--allow-data-change")


def test_a_changed_dataset_is_refused_unless_allowed(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 3})
    build_trainer(load_config(config), tmp_path / "run").run()
    other = build_code_dataset(tmp_path, ["json"], val_fraction=0.3)
    changed = write_config(tmp_path / "changed.toml", other, train={"max_steps": 5})
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    _assert_refused(_train(changed, tmp_path / "run"), "--allow-data-change")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before
    # another corpus, another BPE: the same text would be other ids, which new data alone does not excuse
    _assert_refused(_train(changed, tmp_path / "run", "--allow-data-change"), "another tokenizer",
                    "--allow-tokenizer-change")
    code, _, err = _train(changed, tmp_path / "run", "--allow-data-change", "--allow-tokenizer-change")
    assert code == 0, err


def test_a_resume_with_changed_settings_says_what_changed_and_keeps_the_original(dataset, tmp_path):
    run = tmp_path / "run"
    build_trainer(load_config(write_config(tmp_path / "a.toml", dataset, train={"max_steps": 3})), run).run()
    original = (run / "run_config.json").read_text()
    changed = write_config(tmp_path / "b.toml", dataset, train={"max_steps": 4}, optim={"lr": 0.02})
    build_trainer(load_config(changed), run).run()
    assert (run / "run_config.json").read_text() == original
    (entry,) = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 3 and entry["changes"]["optim.lr"] == [0.01, 0.02]
    assert entry["changes"]["train.max_steps"] == [3, 4]
    said = [line for line in (run / "train.log").read_text().splitlines() if "resumed with changed settings" in line]
    assert len(said) == 1 and "optim.lr: 0.01 -> 0.02" in said[0] and "train.max_steps: 3 -> 4" in said[0]
    build_trainer(load_config(changed), run).run()  # nothing changed this time: nothing appended
    assert len((run / "config_history.jsonl").read_text().splitlines()) == 1


def test_a_checkpoint_whose_metadata_would_run_code_is_refused_everywhere(dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 3})
    build_trainer(load_config(config), tmp_path / "run").run()
    target = tmp_path / "run" / "checkpoints" / "step_00000003" / ".metadata"

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    metadata = pickle.loads(target.read_bytes())
    metadata.planner_data = Payload()
    target.write_bytes(pickle.dumps(metadata))
    # the attacker fixes the manifest too, so only the unpickler stands in the way
    manifest = json.loads((target.parent / "manifest.rank0.json").read_text())
    ckpt.write_manifest(target.parent, 0, manifest["files"])
    # resume: the bad checkpoint is set aside as .bad (a fresh run then starts), the payload never runs
    code, _, err = _train(config, tmp_path / "run")
    assert code == 0, err
    bad = tmp_path / "run" / "checkpoints" / "step_00000003.bad"
    assert bad.exists()
    for args in (["generate", "--model", str(bad), "--prompt-ids", "1,2"], ["convert", str(bad), "out"]):
        _assert_refused(zaya_command(args), "not allowed")
    assert not (tmp_path / "pwned").exists()
