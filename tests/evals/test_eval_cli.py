"""`zaya eval`: --tasks (lm-evaluation-harness) and --data (held-out loss), their results files and the
run's evals.jsonl lines, and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from zaya import checkpoint
from zaya.evals.records import run_dir_of, task_metrics

TASKS = Path(__file__).parent / "tasks"
LM_EVAL_KEYS = {"time", "step", "model", "kind", "tasks", "num_fewshot", "limit", "results_file"}
HELDOUT_KEYS = {"time", "step", "model", "kind", "data", "split", "seq_len", "max_batches", "loss", "ppl"}


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "evals.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_eval_tasks_writes_the_results_and_one_evals_line(cli, trained_run, in_tasks_dir):
    before = len(_records(trained_run))
    code, out, err = cli("eval", "--model", trained_run, "--tasks", "zaya_code_choice,zaya_code_complete",
                         "--include-path", TASKS, "--limit", "6", "--batch-size", "4", "--device", "cpu")
    assert code == 0, err
    records = _records(trained_run)
    assert len(records) == before + 1
    record = records[-1]
    assert set(record) == LM_EVAL_KEYS
    assert (record["kind"], record["step"], record["model"]) == ("lm_eval", 30, str(trained_run))
    assert (record["limit"], record["num_fewshot"]) == (6, None)
    results_file = trained_run / record["results_file"]
    assert record["results_file"].startswith("evals/lm_eval-step_00000030-") and results_file.is_file()
    results = json.loads(results_file.read_text())
    assert results["results"]["zaya_code_choice"]["sample_len"] == 6
    assert set(record["tasks"]) == {"zaya_code_choice", "zaya_code_complete"}
    assert set(record["tasks"]["zaya_code_choice"]) == {"acc", "acc_norm"}
    assert record["tasks"]["zaya_code_choice"]["acc"] == results["results"]["zaya_code_choice"]["acc,none"]
    assert set(record["tasks"]["zaya_code_complete"]) == {"exact_match"}
    # the human-readable table and where everything went
    assert "zaya_code_choice" in out and "acc_norm" in out and "exact_match" in out
    assert str(results_file) in out and "evals.jsonl" in out


def test_eval_tasks_output_goes_where_asked_and_a_checkpoint_counts_as_its_run(cli, trained_run, in_tasks_dir,
                                                                              tmp_path):
    step_dir = checkpoint.resolve_checkpoint(trained_run)
    code, _, err = cli("eval", "--model", step_dir, "--tasks", "zaya_code_choice", "--include-path", TASKS,
                       "--limit", "2", "--num-fewshot", "1", "--output", tmp_path / "r.json", "--device", "cpu")
    assert code == 0, err
    record = _records(trained_run)[-1]
    assert (record["model"], record["step"], record["num_fewshot"]) == (str(step_dir), 30, 1)
    assert (trained_run / record["results_file"]).resolve() == (tmp_path / "r.json").resolve()
    assert json.loads((tmp_path / "r.json").read_text())["n-shot"]["zaya_code_choice"] == 1


def test_eval_data_keeps_its_json_and_records_a_heldout_line(cli, trained_run, dataset_dir):
    code, out, err = cli("eval", "--model", trained_run, "--data", dataset_dir, "--seq-len", "16",
                         "--max-batches", "2", "--batch-size", "2")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"model", "data", "split", "seq_len", "batches", "tokens", "loss", "perplexity"}
    record = _records(trained_run)[-1]
    assert set(record) == HELDOUT_KEYS
    assert (record["kind"], record["step"], record["split"], record["seq_len"]) == ("heldout", 30, "val", 16)
    assert (record["data"], record["max_batches"]) == (str(dataset_dir), 2)  # what was evaluated, for the report
    assert record["loss"] == result["loss"] and record["ppl"] == pytest.approx(result["perplexity"])


def test_an_hf_directory_has_no_run_to_record_in(cli, hf_export, dataset_dir):
    assert run_dir_of(hf_export) is None
    code, _, err = cli("eval", "--model", hf_export, "--data", dataset_dir, "--seq-len", "16", "--max-batches", "1")
    assert code == 0, err
    assert not (hf_export / "evals.jsonl").exists()


def test_exactly_one_of_data_and_tasks(cli, trained_run, dataset_dir):
    for args in ([], ["--data", dataset_dir, "--tasks", "zaya_code_choice"]):
        code, _, err = cli("eval", "--model", trained_run, *args)
        _one_line_error(code, err, "exactly one of --data", "--tasks")
    code, _, err = cli("eval", "--model", trained_run, "--data", dataset_dir, "--limit", "3")
    _one_line_error(code, err, "--limit does not apply to --data")
    code, _, err = cli("eval", "--model", trained_run, "--tasks", "x", "--seq-len", "3")
    _one_line_error(code, err, "--seq-len does not apply to --tasks")


def test_an_unknown_task_is_one_line(cli, trained_run, in_tasks_dir, monkeypatch):
    import functools

    from lm_eval.tasks import TaskManager

    # the whole search, local tasks and then every task, without indexing lm_eval's own (~15 s of the suite)
    monkeypatch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__,
                                                                         include_defaults=False))
    code, _, err = cli("eval", "--model", trained_run, "--tasks", "zaya_code_choice,no_such_task_anywhere",
                       "--include-path", TASKS)
    _one_line_error(code, err, "unknown lm_eval task no_such_task_anywhere", "lm_eval ls tasks")


def test_without_lm_eval_the_error_says_how_to_install_it(cli, trained_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    code, _, err = cli("eval", "--model", trained_run, "--tasks", "zaya_code_choice")
    _one_line_error(code, err, "pip install 'zaya-stack[eval]'")


def test_a_task_whose_data_cannot_be_downloaded_is_one_line(cli, trained_run, in_tasks_dir, monkeypatch):
    import lm_eval

    def offline(**kwargs):  # what `datasets` raises for a Hub dataset offline or out of reach
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    code, _, err = cli("eval", "--model", trained_run, "--tasks", "zaya_code_choice", "--include-path", TASKS)
    _one_line_error(code, err, "Couldn't reach 'Rowan/hellaswag'", "must be downloaded first")


def test_task_metrics_drop_stderr_and_keep_filters():
    results = {"results": {"t": {"alias": "t", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.1,
                                 "exact_match,strict-match": 1.0, "exact_match_stderr,strict-match": "N/A",
                                 "bits_per_byte,none": 1.5}},
               "groups": {"g": {"acc,none": 0.25}}}
    assert task_metrics(results) == {"t": {"acc": 0.5, "exact_match,strict-match": 1.0, "bits_per_byte": 1.5},
                                     "g": {"acc": 0.25}}
