"""`zaya report`: numbers formatted for people, the run summary (time, losses, throughput, memory, evaluations),
the page and the command's text."""

import json
import math

import pytest

from zaya.cli import main
from zaya.errors import ZayaError
from zaya.report import numbers
from zaya.report.report import build_report, make_report
from zaya.report.summary import eval_rows, format_text, read_evals, summarize, summary_rows

# ---- numbers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (7, "7"), (1234567, "1,234,567"), (-1234567, "-1,234,567"), (2.6, "3"),
    (1e18, "1,000,000,000,000,000,000"), (None, "–"), (math.nan, "–"), (True, "–"), ("12", "–"), (math.inf, "inf"),
])
def test_count(value, text):
    assert numbers.count(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (0.0, "0"), (2.51342, "2.513"), (3.0, "3.000"), (0.1, "0.1000"), (123.456, "123.5"), (-0.5, "-0.5000"),
    (8e-3, "8.00e-3"), (1e-9, "1.00e-9"), (-2.5e-5, "-2.50e-5"), (999.96, "1,000"), (12345.6, "12,346"),
    (1234567, "1,234,567"), (2.5e15, "2.50e15"), (None, "–"), (math.nan, "–"), (-math.inf, "-inf"),
])
def test_number(value, text):
    assert numbers.number(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0.01523, "1.52%"), (0, "0%"), (0.5, "50.0%"), (1.0, "100%"), (-0.1, "-10.0%"), (1e-9, "1.00e-7%"),
    (None, "–"), (math.nan, "–"),
])
def test_percent(value, text):
    assert numbers.percent(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 s"), (1e-9, "1.00e-6 ms"), (0.0123, "12.3 ms"), (0.84, "0.84 s"), (4.2, "4.20 s"), (9.999, "10.0 s"),
    (42.34, "42.3 s"), (59.97, "1 min 00 s"), (252, "4 min 12 s"), (3720, "1 h 02 min"), (3599.8, "1 h 00 min"),
    (90000, "1 d 01 h"), (-5, "-5.00 s"), (None, "–"), (math.nan, "–"),
])
def test_duration(value, text):
    assert numbers.duration(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (2**30, "1.00 GiB"), (int(1.5 * 2**40), "1.50 TiB"),
    (1000 * 2**30, "1,000 GiB"), (-2048, "-2.00 KiB"), (None, "–"),
])
def test_size(value, text):
    assert numbers.size(value) == text


# ---- the summary ----------------------------------------------------------------------------------------


def _rows(steps: int = 20, log_every: int = 1) -> list[dict]:
    """A run whose first two steps are slow (warm-up) and which pauses 3 s for each eval (every 10 steps)."""
    rows, now = [], 1000.0
    for step in range(1, steps + 1):
        seconds = 2.0 if step <= 2 else 0.5
        now += seconds + (3.0 if step % 10 == 0 else 0.0)
        row = {"step": step, "loss": 5.0 - 0.1 * step + (0.5 if step == 20 else 0.0), "lr": 8e-3, "batch_size": 8,
               "tokens": 256 * step, "tokens_per_s": 256 / seconds, "mfu": 0.0152 * 0.5 / seconds,
               "step_time": seconds, "time": now, "peak_memory_bytes": [2**30 + 10 * step, 2**29],
               "expert_load": [[0.25] * 4] * 2}
        if step % 10 == 0:
            row.update(eval_loss=4.2 - 0.01 * step, eval_ppl=math.exp(4.2 - 0.01 * step))
        if step % log_every == 0 or "eval_loss" in row:
            rows.append(row)
    return rows


EVALS = [
    {"time": 5.0, "step": 20, "model": "runs/x", "kind": "heldout", "split": "val", "seq_len": 512, "loss": 3.9,
     "ppl": 49.4, "num_fewshot": None, "limit": None, "results_file": None},
    {"time": 4.0, "step": 10, "model": "runs/x", "kind": "lm_eval", "num_fewshot": 0, "limit": 100,
     "tasks": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.251, "acc_stderr,none": 0.0043,
                             "acc_norm,none": 0.26, "acc_norm_stderr,none": "N/A"}}},
    {"time": 6.0, "step": None, "model": "hf/base", "kind": "lm_eval", "num_fewshot": None, "limit": None,
     "tasks": {"gsm8k": {"exact_match,strict-match": 0.02}}},
]


def test_summary_figures_of_a_run():
    summary = summarize(_rows(), EVALS)
    assert (summary.steps, summary.tokens) == (20, 5120)
    # from the first step's start (time 1000) to the last row (4 s + 9 s of steps + 2 evals of 3 s)
    assert summary.wall_seconds == pytest.approx(19.0)
    assert summary.step_seconds == pytest.approx(13.0) and not summary.step_seconds_estimated
    assert summary.outside_seconds == pytest.approx(6.0)
    assert summary.final_loss == pytest.approx(3.5)
    assert (summary.best_loss, summary.best_loss_step) == (pytest.approx(3.1), 19)
    assert (summary.eval_loss, summary.eval_step) == (pytest.approx(4.0), 20)
    assert summary.eval_ppl == pytest.approx(math.exp(4.0))
    # the warm-up steps (2 s each) are left out: the medians are the steady state's
    assert summary.median_tokens_per_s == pytest.approx(512.0)
    assert summary.median_mfu == pytest.approx(0.0152)
    assert summary.throughput_steps == (6, 20)
    assert summary.peak_memory_bytes == [2**30 + 200, 2**29]
    texts = dict(summary_rows(summary))
    assert texts["tokens"] == "5,120" and texts["wall time"] == "19.0 s"
    assert texts["best training loss"] == "3.100 (step 19)" and texts["median MFU"] == "1.52% (steps 6-20)"
    assert texts["peak memory"] == "rank 0: 1.00 GiB, rank 1: 512 MiB"


def test_evaluations_become_rows_in_step_order():
    rows = eval_rows(summarize([], EVALS))
    assert rows == [
        ("hellaswag (0-shot, limit 100)", "acc", "0.2510 ± 0.0043", "10"),
        ("hellaswag (0-shot, limit 100)", "acc_norm", "0.2600", "10"),
        ("held-out val (seq 512)", "loss", "3.900", "20"),
        ("held-out val (seq 512)", "ppl", "49.40", "20"),
        ("gsm8k", "exact_match (strict-match)", "0.02000", "–"),  # not a checkpoint of this run: no step
    ]


def test_sparse_rows_estimate_the_time_in_steps():
    summary = summarize(_rows(log_every=5))
    assert summary.step_seconds_estimated
    assert summary.step_seconds == pytest.approx(5 * 0.5 * 4)  # each row's step time for the steps since the last
    assert summary.wall_seconds == pytest.approx(19.0 - 3.0)  # steps 1-5 (5.5 s) estimated from step 5's 0.5 s


def test_a_run_of_a_few_steps_and_missing_figures():
    summary = summarize([{"step": 1, "loss": 3.0, "tokens_per_s": 100.0}])
    assert summary.median_tokens_per_s == 100.0  # shorter than the warm-up: every step counts
    texts = dict(summary_rows(summary))
    assert texts["wall time"] == "–" and texts["final held-out loss"] == "–" and texts["median MFU"] == "–"
    assert texts["peak memory"] == "–"


def test_many_ranks_show_the_extremes():
    summary = summarize([{"step": 1, "peak_memory_bytes": [2**30] * 5 + [2**31] + [2**29] * 10}])
    assert dict(summary_rows(summary))["peak memory"] == "max 2.00 GiB (rank 5), min 512 MiB (rank 6), 16 ranks"


def test_evals_file_tolerates_a_torn_last_line_and_names_a_bad_one(tmp_path):
    path = tmp_path / "evals.jsonl"
    path.write_text(json.dumps(EVALS[0]) + "\n" + '{"time": 1, "st')
    assert read_evals(tmp_path) == [EVALS[0]]
    path.write_text("not json\n" + json.dumps(EVALS[0]) + "\n")
    with pytest.raises(ZayaError, match=r"evals\.jsonl: not an evaluation log \(line 1 is not a JSON object\)"):
        read_evals(tmp_path)
    assert read_evals(tmp_path / "nothing") == []


# ---- the page and the command -----------------------------------------------------------------------------


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows()))
    (run / "evals.jsonl").write_text("".join(json.dumps(record) + "\n" for record in EVALS))
    (run / "run_config.json").write_text(json.dumps({"train": {"max_steps": 20}}))
    return run


def test_report_page_has_the_summary_the_evaluations_and_the_plots(tmp_path):
    run = _run_dir(tmp_path)
    report = build_report(run)
    assert report.index == make_report(run) == run / "report" / "index.html"
    assert [path.name for path in report.figures] == ["loss.png", "schedule.png", "throughput.png",
                                                      "expert_load.png"]
    assert all(path.stat().st_size > 0 for path in report.figures)
    page = report.index.read_text()
    assert page.index("<th>steps</th><td>20</td>") < page.index("<h2>evaluations</h2>") < page.index("loss.png")
    assert "<td>5,120</td>" in page and "<td>19.0 s</td>" in page and "1.52% (steps 6-20)" in page
    assert "<td class='num'>0.2510 ± 0.0043</td>" in page and "gsm8k" in page


def test_zaya_report_prints_the_summary_aligned(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert main(["report", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {run / 'report' / 'index.html'}"
    assert lines[1].split() == ["steps", "20"]
    summary = lines[1:lines.index("")]
    assert len({line.index(line.split("  ")[-1].strip()) for line in summary}) == 1  # one column of values
    assert "median tokens/s" in lines[10] and lines[10].endswith("512.0 (steps 6-20)")
    evals = lines[lines.index("evaluations:") + 1:]
    assert evals[0].split() == ["task", "metric", "value", "step"]
    assert len({len(line) for line in evals[:5]}) == 1  # right-aligned values and steps: equal widths
    assert "hellaswag (0-shot, limit 100)" in evals[1] and evals[1].endswith("0.2510 ± 0.0043    10")


def test_format_text_without_evaluations_has_no_evaluation_table():
    text = format_text(summarize(_rows()))
    assert "evaluations" not in text and text.splitlines()[0].split() == ["steps", "20"]


# ---- a rerun's evaluations --------------------------------------------------------------------------------


def test_a_checkpoint_evaluated_again_has_one_row_per_task_metric_and_step(tmp_path):
    from zaya.evals.records import append_record, heldout_record, lm_eval_record

    run = _run_dir(tmp_path)
    (run / "evals.jsonl").unlink()
    hellaswag = {"results": {"hellaswag": {"acc,none": 0.25, "acc_stderr,none": 0.01}}}
    # `make demo` twice: the second `zaya train` has nothing to do, and `zaya eval` records the same checkpoint again
    for _ in range(2):
        append_record(run, heldout_record("runs/x", 20, "val", 256, 3.9, data="data/stdlib"))
        append_record(run, lm_eval_record("runs/x", 20, hellaswag, 0, 100, "evals/a.json"))
    # the same evaluation of a checkpoint with other weights at that step (a rollback retrained it): the newest
    append_record(run, heldout_record("runs/x/checkpoints/step_00000020", 20, "val", 256, 3.8, data="data/stdlib"))
    # other evaluations of that checkpoint stay rows of their own: another dataset, batches, shots
    append_record(run, heldout_record("runs/x", 20, "val", 256, 4.5, data="data/chats"))
    append_record(run, heldout_record("runs/x", 20, "val", 256, 3.7, data="data/stdlib", max_batches=8))
    append_record(run, lm_eval_record("runs/x", 20, hellaswag, 5, 100, "evals/b.json"))
    assert len(read_evals(run)) == 8
    assert [row[:2] + row[3:] for row in eval_rows(build_report(run).summary)] == [
        ("hellaswag (0-shot, limit 100)", "acc", "20"),
        ("held-out stdlib val (seq 256)", "loss", "20"),
        ("held-out stdlib val (seq 256)", "ppl", "20"),
        ("held-out chats val (seq 256)", "loss", "20"),
        ("held-out chats val (seq 256)", "ppl", "20"),
        ("held-out stdlib val (seq 256, 8 batches)", "loss", "20"),
        ("held-out stdlib val (seq 256, 8 batches)", "ppl", "20"),
        ("hellaswag (5-shot, limit 100)", "acc", "20"),
    ]
    assert dict(((task, metric), value) for task, metric, value, _ in eval_rows(summarize([], read_evals(run))))[
        ("held-out stdlib val (seq 256)", "loss")] == "3.800"
    page = (run / "report" / "index.html").read_text()
    assert page.count("held-out stdlib val (seq 256)<") == 2 and page.count("hellaswag (0-shot, limit 100)<") == 1
