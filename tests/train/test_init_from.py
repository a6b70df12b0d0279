"""Fresh runs started from pretrained weights (`train.init_from`): a run, a zaya checkpoint, a Hugging Face export and
a directory in ZAYA1-base's legacy layout all give the first step the source model's loss on that batch."""

import json
import math

import pytest
import torch

import zaya
from modeling import legacy_config_json
from ranks import zaya_train
from runs import write_config, zaya_command
from zaya.config import load_config
from zaya.data.loader import TokenLoader
from zaya.model.hf import save_hf_state
from zaya.run_dir import INIT_FROM_FILE
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def _first_batch(config_path) -> torch.Tensor:
    """The first global batch a run of this config trains on, as its loader hands it out."""
    config = load_config(config_path)
    data = config.data
    with TokenLoader([(data.path, 1.0)], data.seq_len, config.train.seed, block_size=data.block_size,
                     group_blocks=data.group_blocks) as loader:
        return loader.next_batch(config.train.global_batch_size)


@pytest.fixture(scope="module")
def source(dataset, tmp_path_factory):
    """A trained micro run, its HF export, and the same weights in the legacy layout."""
    root = tmp_path_factory.mktemp("init-source")
    config = write_config(root / "source.toml", dataset, train={"max_steps": 4, "eval_every": 0},
                          checkpoint={"every": 4})
    build_trainer(load_config(config), root / "run").run()
    code, _, err = zaya_command(["convert", root / "run", root / "hf"])
    assert code == 0, err
    model = zaya.load_model(root / "hf", device="cpu")
    legacy = root / "legacy"
    legacy.mkdir()
    save_hf_state(legacy, model.state_dict(), model.config, layout="legacy")
    (legacy / "config.json").write_text(json.dumps(legacy_config_json(model.config)))
    return root


@pytest.mark.slow
def test_a_fresh_run_starts_with_the_loss_of_the_weights_it_starts_from(source, dataset, tmp_path):
    model = zaya.load_model(source / "hf", device="cpu", dtype=torch.float32)
    probe = write_config(tmp_path / "probe.toml", dataset, train={"max_steps": 3, "eval_every": 0, "seed": 11})
    batch = _first_batch(probe)
    with torch.no_grad():
        expected = model.loss(batch[:, :-1], batch[:, 1:]).item()
    assert expected < math.log(model.config.vocab_size) - 0.5  # trained: far from a random start (ln V)
    checkpoint = next((source / "run" / "checkpoints").glob("step_*"))
    for name, path in [("run", source / "run"), ("checkpoint", checkpoint), ("hf", source / "hf"),
                       ("legacy", source / "legacy")]:
        config = write_config(tmp_path / f"{name}.toml", dataset,
                              train={"max_steps": 3, "eval_every": 0, "seed": 11, "init_from": str(path)})
        run = tmp_path / name
        build_trainer(load_config(config), run).run()
        assert read_metrics(run)[0]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5), name
        record = json.loads((run / INIT_FROM_FILE).read_text())
        assert record["kind"] == ("hf" if name in ("hf", "legacy") else "checkpoint")
        assert record["fingerprint"].startswith("sha256:") and len(record["fingerprint"]) == 71
        assert "initialised from" in (run / "train.log").read_text()
    # the HF export and the legacy directory hold the same weights, in files of other names and layouts
    fingerprints = {json.loads((tmp_path / name / INIT_FROM_FILE).read_text())["fingerprint"]
                    for name in ("run", "checkpoint", "hf", "legacy")}
    assert len(fingerprints) == 3  # the run is its newest checkpoint

    # a resume takes its own checkpoint's weights, not the source's again
    config = write_config(tmp_path / "hf.toml", dataset,
                          train={"max_steps": 4, "eval_every": 0, "seed": 11, "init_from": str(source / "hf")})
    build_trainer(load_config(config), tmp_path / "hf").run()
    log = (tmp_path / "hf" / "train.log").read_text()
    assert log.count("initialised from") == 1 and "resumed from" in log


@pytest.mark.slow
def test_sharded_ranks_start_from_the_same_weights(source, dataset, tmp_path):
    """Two ranks, each loading its shards and, with the experts split over them (`parallel.ep = 2`), its
    experts: from an HF directory (read whole, sharded on the way in) under full sharding, from a checkpoint
    (resharded by DCP) under ZeRO-1."""
    one = write_config(tmp_path / "one.toml", dataset,
                       train={"max_steps": 3, "eval_every": 0, "seed": 11, "init_from": str(source / "hf")})
    build_trainer(load_config(one), tmp_path / "one").run()
    expected = read_metrics(tmp_path / "one")[0]["loss"]
    checkpoint = next((source / "run" / "checkpoints").glob("step_*"))
    for name, path, sharding in [("hf", source / "hf", "full"), ("checkpoint", checkpoint, "zero1")]:
        run = tmp_path / name
        results = zaya_train(one, run, 2, f"train.init_from={path}", f"parallel.sharding={sharding}",
                             "parallel.ep=2")
        assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
        assert read_metrics(run)[0]["loss"] == pytest.approx(expected, rel=1e-5), name


@pytest.mark.parametrize(("sets", "says"), [
    (["model.vocab_size=1024"], "model.vocab_size = 512 there, 1024 here"),
    (["model.hidden_size=96"], "model.hidden_size = 128 there, 96 here"),
    (["train.init_from=/nonexistent/weights"], "train.init_from: /nonexistent/weights: no such directory"),
], ids=["vocabulary", "shape", "missing"])
def test_weights_of_another_model_are_one_line_and_nothing_is_written(source, dataset, tmp_path, sets, says):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 3, "init_from": str(source / "hf")})
    args = ["train", config, "--run-dir", tmp_path / "run"]
    for item in sets:
        args += ["--set", item]
    code, _, err = zaya_command(args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "train.init_from" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_a_later_phase_starts_from_its_own_weights_with_a_fresh_optimizer(source, dataset, tmp_path):
    # continued pre-training from scratch for two steps, then a phase that starts from the export (as SFT from
    # another model would): its first step has the export's loss on its first batch
    model = zaya.load_model(source / "hf", device="cpu", dtype=torch.float32)
    train = {"max_steps": 4, "eval_every": 0, "seed": 11, "global_batch_size": 8, "micro_batch_size": 8}
    config = write_config(tmp_path / "phases.toml", dataset, train=train, checkpoint={"every": 10},
                          phases=[{"name": "pre", "tokens": 2 * 8 * 32},
                                  {"name": "sft", "init_from": str(source / "hf")}])
    with torch.no_grad():
        batch = _first_batch(config)  # a phase's loader starts at its own beginning
        expected = model.loss(batch[:, :-1], batch[:, 1:]).item()
    run = tmp_path / "run"
    build_trainer(load_config(config), run).run()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert abs(rows[1]["loss"] - expected) > 0.1  # the first phase's own weights were far from it
    record = json.loads((run / "init_from.sft.json").read_text())
    assert record["kind"] == "hf" and not (run / INIT_FROM_FILE).exists()
    assert "step 2: phase 'sft' initialised from" in (run / "train.log").read_text()


def test_phase_sources_are_checked_before_the_run_trains(dataset, tmp_path):
    config = write_config(tmp_path / "bad.toml", dataset, phases=[{"name": "pre", "tokens": 256},
                                                                  {"name": "sft", "init_from": str(tmp_path / "none")}])
    with pytest.raises(zaya.ZayaError, match=r"^phases\.1\.init_from: .*none"):
        build_trainer(load_config(config), tmp_path / "run")
    both = write_config(tmp_path / "both.toml", dataset, train={"init_from": str(tmp_path)},
                        phases=[{"name": "only", "init_from": str(tmp_path)}])
    with pytest.raises(zaya.ZayaError, match=r"train\.init_from and phases\.0\.init_from both say"):
        load_config(both)
    assert not (tmp_path / "run").exists()
