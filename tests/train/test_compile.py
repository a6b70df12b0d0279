"""`train.compile`: "auto" is off on the CPU (on accelerators on), anything but true, false or "auto" is one clear
error, and a compiled run trains as the eager one does, with its blocks recomputed in backward too (the
recomputation compiles into the block's graph). Compiled here through AOT autograd without generating code
(the `aot_eager` backend): what the trainer hands the compiler is all traced, in full graphs."""

import pytest
import torch
from torch._dynamo.utils import counters

from runs import write_config
from zaya.config import load_config
from zaya.errors import ZayaError
from zaya.training import build_trainer


def test_auto_is_off_on_the_cpu_and_other_values_are_one_clear_error(dataset, tmp_path):
    trainer = build_trainer(load_config(write_config(tmp_path / "run.toml", dataset, train={"compile": "auto"})),
                            tmp_path / "run")
    assert trainer.config.train.compile is False and trainer.config.parallelize.compile is False
    with pytest.raises(ZayaError, match=r"key 'train\.compile' must be true, false or \"auto\", got 'yes'"):
        load_config(write_config(tmp_path / "bad.toml", dataset, train={"compile": "yes"}))


def test_a_compiled_run_with_recomputed_blocks_trains_as_the_eager_one(dataset, tmp_path, monkeypatch):
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **{**options, "backend": "aot_eager"}))
    rows = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        config = write_config(tmp_path / f"{compiled}.toml", dataset,
                              model={"preset": "micro", "num_hidden_layers": 3},
                              train={"max_steps": 2, "compile": compiled, "activation_checkpointing": "full",
                                     "eval_every": 0})
        rows[compiled] = build_trainer(load_config(config), tmp_path / f"run-{compiled}").run()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # fp32: `zaya::grouped_mm`
    assert rows[True]["loss"] == pytest.approx(rows[False]["loss"], rel=1e-5)
    assert rows[True]["grad_norm"] == pytest.approx(rows[False]["grad_norm"], rel=1e-4)
