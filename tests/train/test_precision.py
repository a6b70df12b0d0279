"""train.precision = "auto": the precision this device is fast in, decided once per run, the same on every rank,
recorded in the run and its checkpoints, and kept by a resume whatever the device measures then."""

import functools
import json

import pytest
import torch

from runs import write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.device import auto_precision, fast_bf16_matmul
from zaya.training import build_trainer


def _fast(answer: bool):
    return lambda device: answer


@pytest.mark.parametrize("fast", [True, False], ids=["bf16", "fp32"])
def test_auto_trains_in_the_measured_precision_and_records_it(dataset, tmp_path, fast):
    measured = "bf16" if fast else "fp32"
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2, "precision": "auto",
                                                                 "eval_every": 0}, optim={"ns_dtype": "bfloat16"})
    run = tmp_path / "run"
    trainer = build_trainer(load_config(config), run, measure_bf16=_fast(fast))
    trainer.run()
    assert trainer.config.precision == trainer.config.train.precision == measured
    assert trainer.config.optim.ns_dtype == ("bfloat16" if fast else "float32")
    assert json.loads((run / "run_config.json").read_text())["train"]["precision"] == measured
    assert ckpt.read_json(ckpt.resolve_checkpoint(run) / ckpt.INFO_FILE)["precision"] == measured
    assert f"cpu (cpu), {measured}, full sharding;" in (run / "train.log").read_text()


def test_a_resumed_run_keeps_its_precision_when_the_measurement_differs(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 4, "precision": "auto",
                                                                             "eval_every": 0},
                                      checkpoint={"every": 2}))
    run = tmp_path / "run"
    first = build_trainer(config, run, measure_bf16=_fast(False))  # a machine under load measures slow bf16
    first.run()
    assert first.config.precision == "fp32"
    resumed = build_trainer(load_config(write_config(tmp_path / "more.toml", dataset,
                                                     train={"max_steps": 6, "precision": "auto", "eval_every": 0},
                                                     checkpoint={"every": 2})),
                            run, measure_bf16=_fast(True))  # ... and fast bf16 now
    assert resumed.resume_from.name == "step_00000004"
    assert resumed.config.precision == "fp32" and resumed.config.optim.ns_dtype == "float32"
    resumed.run()
    assert ckpt.read_json(ckpt.resolve_checkpoint(run) / ckpt.INFO_FILE)["precision"] == "fp32"
    # a run that asks for a precision gets it, whatever the checkpoint says
    explicit = build_trainer(load_config(write_config(tmp_path / "bf16.toml", dataset,
                                                      train={"max_steps": 8, "precision": "bf16"})), run)
    assert explicit.config.precision == "bf16"



@pytest.mark.parametrize(("bf16", "fp32", "chosen"), [
    ([60.0, 61.0, 59.0], [100.0, 99.0, 101.0], "fp32"),  # bf16 at 0.6x fp32: the slower one is not chosen
    ([150.0, 20.0, 149.0], [100.0, 100.0, 300.0], "bf16"),  # one disturbed reading each: the medians decide
    ([100.0, 100.0, 100.0], [100.0, 100.0, 100.0], "fp32"),  # a tie keeps fp32, the exact one
])
def test_auto_precision_on_a_cpu_is_whichever_dtype_measured_faster(bf16, fp32, chosen):
    readings = {torch.bfloat16: iter(bf16), torch.float32: iter(fp32)}
    fast = functools.partial(fast_bf16_matmul, measure=lambda device, dtype: next(readings[dtype]))
    assert auto_precision(torch.device("cpu"), fast) == chosen
