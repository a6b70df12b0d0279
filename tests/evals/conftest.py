"""A really trained micro run, its HF export and the local lm_eval tasks of tasks/ (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# read by `datasets` and `huggingface_hub` when they are imported: this machine has no network
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

TASKS = Path(__file__).parent / "tasks"




@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A micro model trained for 30 steps on the json package's sources; returns the run directory."""
    from runs import build_code_dataset, write_config
    from zaya.config import load_config
    from zaya.training import build_trainer

    root = tmp_path_factory.mktemp("evals")
    data = build_code_dataset(root, ["json"], val_fraction=0.2)
    config = write_config(root / "run.toml", data,
                          train={"max_steps": 30, "eval_every": 1000, "micro_batch_size": 8},
                          checkpoint={"every": 30, "keep": 1}, optim={"lr": 0.01, "ns_dtype": "float32"})
    build_trainer(load_config(config), root / "run").run()
    return root / "run"


@pytest.fixture(scope="session")
def dataset_dir(trained_run) -> Path:
    return trained_run.parent / "code"


@pytest.fixture(scope="session")
def hf_export(trained_run) -> Path:
    """The run's HF export (`zaya convert RUN HF`)."""
    import zaya

    out = trained_run.parent / "hf"
    zaya.convert(trained_run, out)
    return out


@pytest.fixture
def in_tasks_dir(monkeypatch) -> Path:
    """The tasks' data_files are relative to the working directory, as lm_eval resolves them."""
    monkeypatch.chdir(TASKS)
    return TASKS


@pytest.fixture(scope="session")
def task_manager():
    """An lm_eval TaskManager of tasks/ alone (indexing lm_eval's own tasks takes half a minute)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)
