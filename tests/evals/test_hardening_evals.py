"""`zaya eval --tasks` outputs and inputs against a careless or hostile user: the results file replaces only a
regular file and only when asked, evals.jsonl is appended to only as the run's own regular file, and lm_eval is
never handed a task YAML that would hang it or fill the memory. Everything is refused before the evaluation."""

from __future__ import annotations

import json
import os
import re
import sys
import types

import pytest

import zaya.evals.run as run_module
from zaya.errors import ZayaError
from zaya.evals.records import append_record
from zaya.evals.run import TaskRun, check_task_files, run_tasks


@pytest.fixture
def evaluation(monkeypatch, tmp_path):
    """run_tasks with a model directory that is no run, no model, and an lm_eval that only counts its
    evaluations: what is tested happens before and after them."""
    calls = []
    fake = types.SimpleNamespace(simple_evaluate=lambda **kwargs: calls.append(kwargs) or {"results": {}})
    monkeypatch.setattr(run_module, "import_lm_eval", lambda: fake)
    monkeypatch.setattr(run_module, "run_dir_of", lambda model: None)
    monkeypatch.setattr(run_module, "checkpoint_step", lambda model: None)
    monkeypatch.setitem(sys.modules, "zaya.evals.harness", types.SimpleNamespace(ZayaLM=lambda **kwargs: None))
    model = tmp_path / "model"
    model.mkdir()

    def evaluate(output, overwrite=False):
        return run_tasks(TaskRun(model=model, tasks=("t",), output=output, overwrite=overwrite), task_manager=object())

    evaluate.calls = calls
    return evaluate


@pytest.mark.parametrize(("kind", "overwrite", "match"), [
    ("file", False, "already exists; pass --overwrite to replace it"),
    ("fifo", True, "exists and is not a regular file; refusing to replace it"),
    ("directory", True, "exists and is not a regular file"),
    ("link", True, "exists and is a symbolic link; refusing to replace it"),
    ("dangling", True, "exists and is a symbolic link"),
    ("long", False, "file name too long"),
])
def test_the_results_file_is_refused_before_the_evaluation(evaluation, tmp_path, kind, overwrite, match):
    path = tmp_path / ("r" * 300 if kind == "long" else "r.json")
    (tmp_path / "target").write_text("a user's file")
    {"file": lambda: path.write_text("a user's file"), "fifo": lambda: os.mkfifo(path), "directory": path.mkdir,
     "link": lambda: path.symlink_to(tmp_path / "target"), "dangling": lambda: path.symlink_to(tmp_path / "none"),
     "long": lambda: None}[kind]()
    with pytest.raises(ZayaError, match=re.escape(match)):
        evaluation(path, overwrite)
    assert not evaluation.calls and (tmp_path / "target").read_text() == "a user's file"
    assert not (tmp_path / "none").exists()


def test_the_results_file_is_replaced_when_asked(evaluation, tmp_path):
    path = tmp_path / "deep" / "r.json"
    path.parent.mkdir()
    path.write_text("older results")
    done = evaluation(path, overwrite=True)
    assert done.results_file == path and json.loads(path.read_text()) == {"results": {}}
    assert os.listdir(path.parent) == ["r.json"]


def test_a_runs_evals_directory_and_log_are_checked_before_the_evaluation(evaluation, monkeypatch, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(run_module, "run_dir_of", lambda model: run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "evals").symlink_to(elsewhere)
    with pytest.raises(ZayaError, match=r"evals: a symbolic link; refusing to write evaluation results there"):
        evaluation(None)
    (run / "evals").unlink()
    os.mkfifo(run / "evals.jsonl")
    with pytest.raises(ZayaError, match=r"evals\.jsonl: not a regular file; refusing to append to it"):
        evaluation(None)
    assert not evaluation.calls and os.listdir(elsewhere) == []


@pytest.mark.parametrize(("kind", "match"), [
    ("fifo", "not a regular file; refusing to append to it"),
    ("link", "a symbolic link; refusing to append to it"),
    ("directory", "evals.jsonl: not a regular file; refusing to append to it"),
])
def test_append_record_never_blocks_or_writes_through_a_link(tmp_path, kind, match):
    path = tmp_path / "evals.jsonl"
    (tmp_path / "target").write_text("")
    {"fifo": lambda: os.mkfifo(path), "link": lambda: path.symlink_to(tmp_path / "target"),
     "directory": path.mkdir}[kind]()
    with pytest.raises(ZayaError, match=re.escape(match)):
        append_record(tmp_path, {"step": 1})
    assert (tmp_path / "target").read_text() == ""


def test_append_record_appends_one_line(tmp_path):
    append_record(tmp_path, {"step": 1})
    append_record(tmp_path, {"step": 2})
    assert (tmp_path / "evals.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.parametrize(("kind", "match"), [
    ("fifo", "not a regular file; a task YAML must be one"),
    ("zero", "not a regular file; a task YAML must be one"),
    ("loop", "cannot read the task file (a loop of symbolic links)"),
    ("large", "larger than 4 MiB, the limit for a task YAML"),
])
def test_task_yamls_that_would_hang_lm_eval_are_refused(tmp_path, kind, match):
    nested = tmp_path / "tasks" / "more"
    nested.mkdir(parents=True)
    (nested.parent / "fine.yaml").write_text("task: fine\n")
    path = nested / "bad.yaml"
    {"fifo": lambda: os.mkfifo(path), "zero": lambda: path.symlink_to("/dev/zero"),
     "loop": lambda: path.symlink_to(path), "large": lambda: os.truncate(path.write_text("") or path, 5 << 20)}[kind]()
    with pytest.raises(ZayaError, match=re.escape(match)):
        check_task_files(tmp_path / "tasks")
    with pytest.raises(ZayaError, match=re.escape(match)):
        run_module.task_manager_for((str(path),), None)  # a task named by its path
