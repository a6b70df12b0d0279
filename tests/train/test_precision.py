"""train.precision = "auto": the precision this device is fast in, the same on every rank, recorded in the run."""

import json

import pytest

from conftest import write_config
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.train import trainer as trainer_module
from zaya.train.trainer import Trainer


@pytest.mark.parametrize("measured", ["bf16", "fp32"])
def test_auto_trains_in_the_measured_precision_and_records_it(dataset, tmp_path, monkeypatch, measured):
    monkeypatch.setattr(trainer_module, "resolve_precision", lambda precision, device: measured)
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2, "precision": "auto",
                                                                 "eval_every": 0})
    run = tmp_path / "run"
    trainer = Trainer(load_config(config), run)
    trainer.run()
    assert trainer.config.train.precision == measured
    assert trainer.config.optim.ns_dtype == ("bfloat16" if measured == "bf16" else "float32")
    assert json.loads((run / "run_config.json").read_text())["train"]["precision"] == measured
    assert f"cpu (cpu), {measured};" in (run / "train.log").read_text()


def test_auto_with_compile_on_a_slow_bf16_device_is_one_clear_error(dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "resolve_precision", lambda precision, device: "fp32")
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2, "precision": "auto",
                                                                 "compile": True})
    with pytest.raises(ZayaError, match=r"train\.compile needs bf16"):
        Trainer(load_config(config), tmp_path / "run").run()
    assert not list((tmp_path / "run").glob("checkpoints/step_*")) and not (tmp_path / "run" / "metrics.jsonl").exists()
