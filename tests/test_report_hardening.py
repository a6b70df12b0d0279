"""`zaya report` against hostile run directories: every log is a bounded regular file read as a stream, rows of
the wrong type are skipped with one warning, and the report writes only its own files, never through a link."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

import zaya.report.logs as logs
from zaya.errors import ZayaError
from zaya.report.report import build_report, read_all_incidents, run_report
from zaya.report.summary import read_evals, summarize
from zaya.resilience.incidents import timeline
from zaya.schema import Fields


def _one_line(cli, args, match):
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("zaya: error: ") and match in lines[0], err


def _row(step: int, **changes) -> dict:
    return {"step": step, "loss": 5.0 - 0.01 * step, "lr": 1e-3, "batch_size": 8, "tokens": 256 * step,
            "tokens_per_s": 1000.0, "mfu": 0.01, "step_time": 0.25, "time": 1000.0 + step / 4,
            "peak_memory_bytes": [2**30, 2**29], "expert_load": [[0.25] * 4] * 2, **changes}


def _run(tmp_path, rows: list, name: str = "run") -> os.PathLike:
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                                               for row in rows))
    return run


@pytest.mark.parametrize(("file", "kind", "match"), [
    ("metrics.jsonl", "fifo", "metrics.jsonl: a FIFO, not a regular file"),
    ("metrics.jsonl", "zero", "metrics.jsonl: a character device, not a regular file"),
    ("metrics.jsonl", "directory", "metrics.jsonl: a directory, not a regular file"),
    ("metrics.jsonl", "loop", "metrics.jsonl: cannot read (a loop of symbolic links)"),
    ("metrics.jsonl", "urandom_copy", "metrics.jsonl: not a metrics log"),
    ("evals.jsonl", "fifo", "evals.jsonl: a FIFO"), ("evals.jsonl", "zero", "evals.jsonl: a character device"),
    ("incidents.jsonl", "fifo", "incidents.jsonl: a FIFO"),
    ("supervisor/incidents.jsonl", "zero", "incidents.jsonl: a character device"),
    ("run_config.json", "fifo", "run_config.json: a FIFO"), ("run_config.json", "zero", "a character device"),
    ("run_config.json", "deep", "run_config.json: nested more than 64 deep"),
    ("report", "link", "report: a symbolic link; refusing to write the report through it"),
    ("report", "file", "report: exists and is not a directory"),
    ("report/loss.png", "link", "loss.png: exists and is a symbolic link; refusing to replace it"),
    ("report/index.html", "fifo", "index.html: exists and is not a regular file"),
])
def test_every_file_of_a_report_is_one_line_never_a_hang(cli, tmp_path, file, kind, match):
    run = _run(tmp_path, [_row(1), _row(2)])
    path = run / file
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "loss.png").write_text("a user's picture")
    {"fifo": lambda: os.mkfifo(path), "zero": lambda: path.symlink_to("/dev/zero"), "directory": path.mkdir,
     "loop": lambda: path.symlink_to(path), "deep": lambda: path.write_text("[" * 100 + "]" * 100),
     "urandom_copy": lambda: path.write_bytes(b"\x93\x00\xffrandom bytes\n" * 3),
     "file": lambda: path.write_text("x"),
     "link": lambda: path.symlink_to(target if file == "report" else target / "loss.png")}[kind]()
    _one_line(cli, ["report", run], match)
    assert (target / "loss.png").read_text() == "a user's picture" and os.listdir(target) == ["loss.png"]


def test_rows_of_the_wrong_type_are_skipped_with_one_warning(tmp_path):
    rows = [_row(1), _row(2, loss="low"), '{"step": 3, "loss": 1e999}', {**_row(4), "step": 10**400},
            _row(5, peak_memory_bytes=["1 GB"]), _row(6, expert_load=[[1, 2], [3]]), "[1, 2]", "not json",
            _row(7, tokens=10**30), _row(8, expert_load=[[0.5] * 2] * 4), _row(9, time={"at": 1}),
            _row(10, tokens_per_s=-1e308, mfu=1e308, expert_load=[[1e300, -1, 0, 0], [math.inf, math.nan, 0, 0]]),
            '{"step": 11, "lo']  # the last line torn: left out without a word
    run = _run(tmp_path, rows)
    done = run_report(run)
    summary = done.report.summary
    # the report of the good rows: 1, 3 (an infinite loss is a number), 10 (numbers too large to plot are left out of
    # the plots, loads outside [0, 1] drawn at the bound)
    assert summary.steps == 10 and summary.final_loss == pytest.approx(4.9) and summary.best_loss == 4.9
    assert summary.peak_memory_bytes == [2**30, 2**29]
    assert len(done.warnings) == 1
    warning = done.warnings[0]
    assert "metrics.jsonl: skipped 9 of 12 metrics rows (line 2: field 'loss' must be a number, got 'low')" in warning
    page = done.report.index.read_text()
    assert "<th>steps</th><td>10</td>" in page


@pytest.mark.parametrize(("record", "match"), [
    ({"time": "yesterday", "step": 1}, "field 'time' must be a number"),
    ({"step": -1}, "field 'step' must be an integer >= 0"),
    ({"step": 10**400}, "field 'step' must be an integer >= 0"),
    ({"limit": 10**400}, "field 'limit' must be a number, got an integer of about 401 digits"),
    ({"kind": ["lm_eval"]}, "field 'kind' must be a string"),
    ({"tasks": ["hellaswag"]}, "field 'tasks' must be an object"),
    ({"tasks": {"hellaswag": 0.5}}, "field 'tasks.hellaswag' must be an object"),
])
def test_an_evaluation_record_of_the_wrong_type_is_named(record, match):
    with pytest.raises(ZayaError, match=re.escape(f"line 2: {match}")):
        logs._eval_record(Fields({"time": 2.0, **record}, "line 2"))


def test_evaluation_records_of_the_wrong_type_are_skipped_and_the_rest_shown(tmp_path):
    good = {"time": 1.0, "step": 2, "kind": "heldout", "split": "val", "seq_len": 16, "loss": 3.0, "ppl": 20.0}
    bad = [{"time": "yesterday"}, {"step": 10**400}, {"limit": 10**400}, {"tasks": {"hellaswag": 0.5}}]
    run = _run(tmp_path, [_row(1)])
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good, *bad, {**good, "step": 3}]))
    log = logs.read_evals_log(run)
    results = summarize([], log.rows).evals
    assert [(result.task, result.metric) for result in results] == [("held-out val (seq 16)", "loss"),
                                                                     ("held-out val (seq 16)", "ppl")] * 2
    assert log.warnings() == [f"{run / 'evals.jsonl'}: skipped 4 of 6 evaluation records (line 2: field 'time' "
                              "must be a number, got 'yesterday')"]


def test_incident_records_of_the_wrong_type_are_skipped_and_the_rest_shown(tmp_path):
    good = {"time": "2026-01-01T00:00:00.000Z", "event": "incident", "signal": "expert_collapse", "source": "trainer",
            "evidence": ["layer 3: one expert takes 90% of the tokens " + "x" * 5000], "action": "warn"}
    bad = [{**good, "signal": 7}, {**good, "time": 1}, {**good, "evidence": [None]}, {**good, "evidence": "text"},
           {**good, "action": {"a": 1}}]
    (tmp_path / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good, *bad, good]))
    incidents = read_all_incidents(tmp_path)
    assert len(incidents) == 2 and all(len(r["evidence"][0]) == logs.MAX_TEXT for r in incidents)
    assert incidents.warnings == [f"{tmp_path / 'incidents.jsonl'}: skipped 5 of 7 incident records (line 2: field "
                                  "'signal' must be a string, got 7)"]
    assert summarize([], [], incidents).warnings[0].startswith("layer 3: one expert")
    assert "expert_collapse" in timeline(incidents)


def test_a_long_log_is_held_thinned_with_its_figures_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_ROWS", 16)
    rows = [_row(step, loss=5.0 - step / 1000, peak_memory_bytes=[2**20 * step, 1],
                 eval_loss=4.0 - step / 1000 if step % 50 == 0 else None) for step in range(1, 1001)]
    rows[636]["loss"] = 0.5  # the best loss, on a row that thinning alone would drop
    rows[999]["tokens"] = None
    log = logs.read_metrics_log(_run(tmp_path, rows))
    assert len(log.rows) <= 16 + 5 and log.read == 1000 and not log.warnings()
    steps = [row["step"] for row in log.rows]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 1000 and 637 in steps
    summary = summarize(log.rows, [], [], log.peak_memory)
    assert (summary.steps, summary.best_loss, summary.best_loss_step) == (1000, 0.5, 637)
    assert summary.final_loss == pytest.approx(4.0) and summary.eval_loss == pytest.approx(3.0)
    assert summary.tokens == 256 * 999 and summary.peak_memory_bytes == [2**20 * 1000, 1]
    assert summary.step_seconds == pytest.approx(250.0) and summary.step_seconds_estimated


def test_a_line_past_the_bound_is_skipped_without_being_held(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "METRICS_LINE", 4096)
    log = logs.read_metrics_log(_run(tmp_path, [_row(1), _row(2, note="x" * 10_000), _row(3)]))
    assert [row["step"] for row in log.rows] == [1, 3]
    assert log.warnings() == [f"{log.path}: skipped 1 of 3 metrics rows (line 2: longer than 4 KiB)"]


def test_evaluations_and_incidents_keep_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "MAX_RECORDS", 3)
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps({"step": step, "kind": "heldout", "loss": 1.0}) + "\n"
                                                  for step in range(10)))
    assert [record["step"] for record in read_evals(tmp_path)] == [7, 8, 9]
    assert logs.read_evals_log(tmp_path).warnings() == [
        f"{tmp_path / 'evals.jsonl'}: only the newest 3 of 10 evaluation records are shown"]
    (tmp_path / "incidents.jsonl").write_text("".join(json.dumps({"time": f"2026-01-0{day}"}) + "\n"
                                                      for day in range(1, 10)))
    assert [record["time"] for record in read_all_incidents(tmp_path)] == ["2026-01-07", "2026-01-08", "2026-01-09"]


def test_an_expert_load_too_large_to_draw_leaves_the_rest_of_the_row(tmp_path):
    log = logs.read_metrics_log(_run(tmp_path, [_row(1, expert_load=[[0.5] * 128] * 128), _row(2)]))
    assert "expert_load" not in log.rows[0] and log.rows[1]["expert_load"].shape == (2, 4) and not log.skipped


def test_build_report_rejects_a_first_line_that_is_no_row(tmp_path):
    with pytest.raises(ZayaError, match=r"metrics\.jsonl: not a metrics log \(line 1 is not a JSON object\)"):
        build_report(_run(tmp_path, ["[1, 2, 3]", _row(1)]))
