"""The figures at the top of a run report: how long, how many tokens, how good, how fast, how much memory,
every evaluation `zaya eval` recorded in RUN_DIR/evals.jsonl, and the warnings the trainer raised about the
run's health (its `incidents.jsonl`: experts collapsing, say).

Times come from the rows of `metrics.jsonl`: `step_time` is one optimizer step, `time` the wall clock when
its row was written. The run's wall time runs from the first step's start to the last row; the time in steps
sums `step_time` (scaled by the steps between two rows when `logging.log_every` > 1, so then an estimate);
what is left is time outside steps: evaluations, checkpoints, startup, and restarts with the work they lost.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from zaya.report import numbers
from zaya.report.logs import read_evals_log

WARMUP_STEPS = 5  # the first steps (compilation, allocator warm-up) are left out of the throughput medians


@dataclass
class EvalResult:
    """One figure of one evaluation: a task's metric at a step (None: not a training run's checkpoint)."""

    task: str
    metric: str
    value: float
    stderr: float | None = None
    step: int | None = None


@dataclass
class Summary:
    steps: int | None = None
    tokens: int | None = None
    wall_seconds: float | None = None
    step_seconds: float | None = None
    step_seconds_estimated: bool = False  # rows were logged less often than every step
    final_loss: float | None = None
    best_loss: float | None = None
    best_loss_step: int | None = None
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_step: int | None = None
    median_tokens_per_s: float | None = None
    median_mfu: float | None = None
    throughput_steps: tuple[int, int] | None = None  # the first and last step the medians cover
    peak_memory_bytes: list[int] = field(default_factory=list)  # per rank, the most over the run
    evals: list[EvalResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the trainer's own warnings, in time order

    @property
    def outside_seconds(self) -> float | None:
        if self.wall_seconds is None or self.step_seconds is None:
            return None
        return max(0.0, self.wall_seconds - self.step_seconds)


def _number(value) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def read_evals(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/evals.jsonl with the fields the report shows, the newest 4,096 (a torn last line,
    from a crash mid-write, is left out; `zaya.report.logs` says what else is)."""
    return read_evals_log(run_dir).rows


def eval_results(records: list[dict]) -> list[EvalResult]:
    """Each evaluation's figures as rows, in step order (evaluations of no training step last).

    evals.jsonl is a log: a checkpoint evaluated again the same way (the same task and settings, or the same
    dataset, split, window and batches) has a record each time, a rerun's `zaya eval` one more. A row is one
    figure of one checkpoint, so the record written last gives it: one row per task, metric and step."""
    newest: dict[tuple, tuple[tuple, EvalResult]] = {}
    for index, record in enumerate(records):
        step = record.get("step") if isinstance(record.get("step"), int) else None
        order = (step is None, step or 0, record.get("time") or 0, index)
        for n, (identity, result) in enumerate(_record_results(record, step)):
            newest[(identity, result.task, result.metric, step)] = ((*order, n), result)
    return [result for _, result in sorted(newest.values(), key=lambda item: item[0])]


def _record_results(record: dict, step: int | None) -> list[tuple[tuple, EvalResult]]:
    """One record's figures, each with what, besides its task, metric and step, tells its evaluation from others:
    the dataset, split, window and batches of a held-out loss; the shots and limit of a task."""
    results = []
    if record.get("kind") == "heldout":
        identity = ("heldout", record.get("data"), record.get("split", "val"), record.get("seq_len"),
                    record.get("max_batches"))
        data = Path(record["data"]).name if record.get("data") else None
        task = f"held-out {data + ' ' if data else ''}{record.get('split', 'val')}"
        notes = [f"seq {numbers.count(record['seq_len'])}"] if record.get("seq_len") else []
        if record.get("max_batches"):
            notes.append(f"{numbers.count(record['max_batches'])} batches")
        task += f" ({', '.join(notes)})" if notes else ""
        for metric in ("loss", "ppl"):
            value = _number(record.get(metric))
            if value is not None:
                results.append((identity, EvalResult(task, metric, value, step=step)))
        return results
    identity = (record.get("kind"), record.get("num_fewshot"), record.get("limit"))
    for task, metrics in (record.get("tasks") or {}).items():
        label = task + _task_notes(record)
        for key, value in (metrics or {}).items():
            name, _, filter_ = key.partition(",")
            if name.endswith("_stderr") or _number(value) is None:
                continue
            stderr = _number(metrics.get(f"{name}_stderr" + (f",{filter_}" if filter_ else "")))
            metric = name if filter_ in ("", "none") else f"{name} ({filter_})"
            results.append((identity, EvalResult(label, metric, float(value), stderr, step)))
    return results


def _task_notes(record: dict) -> str:
    notes = []
    if record.get("num_fewshot") is not None:
        notes.append(f"{record['num_fewshot']}-shot")
    if record.get("limit"):
        notes.append(f"limit {numbers.count(record['limit'])}")
    return f" ({', '.join(notes)})" if notes else ""


# what the trainer warns about without acting on it: the report lists them
WARNING_SIGNALS = ("expert_collapse",)


def summarize(rows: list[dict], evals: list[dict] = (), incidents: list[dict] = (),
              peak_memory: list[int] | None = None) -> Summary:
    """The summary of a run from its metrics rows, its evals.jsonl records and its incident records; `peak_memory`
    (per rank, over the whole log) stands in for the rows' own when the rows held are a sample of the log."""
    summary = Summary(evals=eval_results(list(evals)))
    summary.warnings = [str((record.get("evidence") or [""])[0]) for record in incidents
                        if record.get("source") == "trainer" and record.get("signal") in WARNING_SIGNALS]
    if not rows:
        return summary
    train = [row for row in rows if _number(row.get("loss")) is not None]
    last = rows[-1]
    summary.steps = last.get("step")
    summary.tokens = next((row["tokens"] for row in reversed(rows) if row.get("tokens") is not None), None)
    if train:
        summary.final_loss = float(train[-1]["loss"])
        best = min(train, key=lambda row: row["loss"])
        summary.best_loss, summary.best_loss_step = float(best["loss"]), best.get("step")
    held_out = [row for row in rows if _number(row.get("eval_loss")) is not None]
    if held_out:
        row = held_out[-1]
        summary.eval_loss, summary.eval_step = float(row["eval_loss"]), row.get("step")
        ppl = _number(row.get("eval_ppl"))
        summary.eval_ppl = ppl if ppl is not None else math.exp(min(summary.eval_loss, 50.0))
    _times(summary, rows)
    _throughput(summary, rows)
    if peak_memory is None:
        _memory(summary, rows)
    else:
        summary.peak_memory_bytes = list(peak_memory)
    return summary


def _times(summary: Summary, rows: list[dict]) -> None:
    timed = [row for row in rows if _number(row.get("time")) is not None and _number(row.get("step_time")) is not None
             and isinstance(row.get("step"), int)]
    if not timed:
        return
    previous, in_steps, estimated = 0, 0.0, False
    for row in timed:
        between = max(1, row["step"] - previous)
        estimated |= between > 1
        in_steps += row["step_time"] * between
        previous = row["step"]
    first = timed[0]
    start = first["time"] - first["step_time"] * max(1, first["step"])
    summary.wall_seconds = max(timed[-1]["time"] - start, in_steps)
    summary.step_seconds, summary.step_seconds_estimated = in_steps, estimated


def _throughput(summary: Summary, rows: list[dict]) -> None:
    measured = [row for row in rows
                if _number(row.get("tokens_per_s")) is not None and isinstance(row.get("step"), int)]
    warm = [row for row in measured if row["step"] > WARMUP_STEPS] or measured  # a short run: all of it
    if not warm:
        return
    summary.median_tokens_per_s = statistics.median(row["tokens_per_s"] for row in warm)
    mfu = [row["mfu"] for row in warm if _number(row.get("mfu")) is not None]
    summary.median_mfu = statistics.median(mfu) if mfu else None
    summary.throughput_steps = (warm[0]["step"], warm[-1]["step"])


def _memory(summary: Summary, rows: list[dict]) -> None:
    peak: list[int] = []
    for row in rows:
        memory = row.get("peak_memory_bytes")
        if isinstance(memory, (int, float)) and not isinstance(memory, bool):
            memory = [memory]
        if not isinstance(memory, list):
            continue
        for rank, value in enumerate(memory):
            if _number(value) is None:
                continue
            if rank >= len(peak):
                peak.extend([0] * (rank + 1 - len(peak)))
            peak[rank] = max(peak[rank], int(value))
    summary.peak_memory_bytes = peak


# ---- as text ------------------------------------------------------------------------------------------

MAX_RANKS_LISTED = 8


def summary_rows(summary: Summary) -> list[tuple[str, str]]:
    """The summary as (label, text) pairs, numbers formatted for people."""
    rows = [("steps", numbers.count(summary.steps)), ("tokens", numbers.count(summary.tokens)),
            ("wall time", numbers.duration(summary.wall_seconds))]
    if summary.step_seconds is not None:
        note = " (estimated: rows every few steps)" if summary.step_seconds_estimated else ""
        rows.append(("time in steps", numbers.duration(summary.step_seconds) + note))
        rows.append(("time outside steps", numbers.duration(summary.outside_seconds)
                     + " (evaluation, checkpoints, startup, restarts)"))
    rows.append(("final training loss", numbers.number(summary.final_loss)))
    best = numbers.number(summary.best_loss)
    if summary.best_loss_step is not None:
        best += f" (step {numbers.count(summary.best_loss_step)})"
    rows.append(("best training loss", best))
    held_out = numbers.number(summary.eval_loss)
    if summary.eval_step is not None:
        held_out += f" (step {numbers.count(summary.eval_step)})"
    rows += [("final held-out loss", held_out), ("final held-out perplexity", numbers.number(summary.eval_ppl))]
    span = ""
    if summary.throughput_steps is not None:
        first, last = summary.throughput_steps
        span = f" (steps {numbers.count(first)}-{numbers.count(last)})"
    rows.append(("median tokens/s", numbers.number(summary.median_tokens_per_s) + span))
    rows.append(("median MFU", numbers.percent(summary.median_mfu) + (span if summary.median_mfu is not None else "")))
    rows.append(("peak memory", _memory_text(summary.peak_memory_bytes)))
    rows += [("warning", text) for text in summary.warnings]
    return rows


def _memory_text(peak: list[int]) -> str:
    if not peak:
        return numbers.MISSING
    if len(peak) == 1:
        return numbers.size(peak[0])
    if len(peak) <= MAX_RANKS_LISTED:
        return ", ".join(f"rank {rank}: {numbers.size(value)}" for rank, value in enumerate(peak))
    high, low = max(range(len(peak)), key=peak.__getitem__), min(range(len(peak)), key=peak.__getitem__)
    return (f"max {numbers.size(peak[high])} (rank {high}), min {numbers.size(peak[low])} (rank {low}), "
            f"{len(peak)} ranks")


EVAL_HEADER = ("task", "metric", "value", "step")


def eval_rows(summary: Summary) -> list[tuple[str, str, str, str]]:
    """The evaluations as (task, metric, value, step) texts."""
    rows = []
    for result in summary.evals:
        value = numbers.number(result.value)
        if result.stderr is not None:
            value += f" ± {_like(result.stderr, value)}"
        rows.append((result.task, result.metric, value, numbers.count(result.step)))
    return rows


def _like(error: float, value: str) -> str:
    """`error` to as many decimals as the formatted `value` shows (0.2510 ± 0.0043), where it has decimals."""
    whole, dot, decimals = value.partition(".")
    if dot and decimals.isdigit() and whole.lstrip("-").isdigit():
        return f"{error:.{len(decimals)}f}"
    return numbers.number(error, 2)


def format_text(summary: Summary) -> str:
    """The summary and the evaluations as aligned plain text, for a terminal."""
    pairs = summary_rows(summary)
    width = max(len(label) for label, _ in pairs)
    lines = [f"{label:<{width}}  {text}" for label, text in pairs]
    table = eval_rows(summary)
    if table:
        widths = [max(len(row[i]) for row in [EVAL_HEADER, *table]) for i in range(4)]
        lines += ["", "evaluations:"]
        for row in [EVAL_HEADER, *table]:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                     row[3].rjust(widths[3])]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
