"""`zaya report RUN_DIR`: PNG plots of a run's metrics and an `index.html` that shows them with a summary at
the top (zaya.report.summary: steps, tokens, time, losses, throughput, memory, evaluations, warnings), the incident
timeline of the run (the trainer's and the supervisor's `incidents.jsonl`), if it has one, and its config.
Every number on the page is formatted for people (zaya.report.numbers).
"""

from __future__ import annotations

import html
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from zaya.errors import ZayaError, storage_error
from zaya.owned import check_output, write_output
from zaya.reading import os_reason, read_json
from zaya.report.logs import Log, exists, read_evals_log, read_incidents_log, read_metrics_log
from zaya.report.plots import FIGURES, write_plots
from zaya.report.summary import EVAL_HEADER, Summary, eval_rows, summarize, summary_rows
from zaya.resilience.incidents import timeline
from zaya.run_dir import INCIDENTS_FILE, REPORT_DIR, RUN_CONFIG_FILE, SUPERVISOR_DIR

STYLE = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}img{max-width:100%}"
         "pre{background:#f4f4f4;padding:1em;overflow:auto}table{border-collapse:collapse;margin-bottom:1em}"
         "th,td{padding:0.15em 0.8em;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}"
         "tr:nth-child(even){background:#f7f7f7}")


@dataclass
class Report:
    index: Path  # RUN_DIR/report/index.html
    figures: list[Path]  # the PNG plots, in the page's order
    summary: Summary
    warnings: list[str] = field(default_factory=list)  # rows left out of the logs, one line per file


@dataclass
class RunReport:
    """What `zaya report` shows: the report (None for a directory with incidents and no metrics, a supervisor's
    state directory), the incident timeline's records, and the warnings of the logs read."""

    report: Report | None
    incidents: list[dict]
    warnings: list[str]


class Incidents(list):
    """Incident records, with the warnings of the files they were read from."""

    warnings: list[str]


def incident_files(path: Path) -> list[Path]:
    """The incident logs of a run directory or a supervisor state directory: its own and its supervisor's
    (anything at those names: a FIFO or a directory there is one error when read, never skipped in silence)."""
    return [p for p in (path / INCIDENTS_FILE, path / SUPERVISOR_DIR / INCIDENTS_FILE) if exists(p)]


def read_all_incidents(path: Path) -> Incidents:
    """Every incident record under `path`, in time order, as `zaya.report.logs` holds them (the newest 4,096 of
    each file); `.warnings` says what was left out."""
    records, warnings = Incidents(), []
    for file in incident_files(Path(path)):
        log = read_incidents_log(file)
        records.extend(log.rows)
        warnings += log.warnings()
    records.sort(key=lambda record: record["time"])
    records.warnings = warnings
    return records


def run_report(run_dir: str | Path) -> RunReport:
    """`zaya report RUN_DIR`: the report of a run with metrics, or of one with no incidents (the error then says
    there are no metrics), and the incident timeline's records."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ZayaError(f"{run_dir}: no such run or state directory")
    incidents = read_all_incidents(run_dir)
    warnings = list(getattr(incidents, "warnings", []))
    metrics = read_metrics_log(run_dir)
    report = None
    if metrics.rows or not incidents:
        report = build_report(run_dir, metrics=metrics, incidents=incidents)
        warnings += [w for w in report.warnings if w not in warnings]
    else:
        warnings += metrics.warnings()
    return RunReport(report, list(incidents), warnings)


def build_report(run_dir: str | Path, *, metrics: Log | None = None, incidents: list[dict] | None = None) -> Report:
    """Write the plots and `index.html` into RUN_DIR/report (the files of those names only: a link, FIFO or
    directory in their place is refused, and so is a `report` that is not a directory); returns where they are,
    the summary and the warnings of the logs read. `metrics` and `incidents`: as already read."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ZayaError(f"{run_dir}: no such run directory")
    metrics = metrics or read_metrics_log(run_dir)
    if not metrics.rows:
        raise ZayaError(f"{run_dir}: no metrics.jsonl rows to report")
    warnings = metrics.warnings()
    if incidents is None:
        incidents = read_all_incidents(run_dir)
    warnings += getattr(incidents, "warnings", [])
    evals = read_evals_log(run_dir)
    warnings += evals.warnings()
    config = _config_text(run_dir / RUN_CONFIG_FILE)
    out = _report_dir(run_dir / REPORT_DIR)
    index = out / "index.html"
    for name in (*FIGURES, index.name):  # before anything is drawn
        check_output(out / name, overwrite=True)
    figures = write_plots(metrics.rows, out)
    summary = summarize(metrics.rows, evals.rows, incidents, metrics.peak_memory)
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>zaya run report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Run report: {html.escape(run_dir.name)}</h1>",
        _summary_table(summary),
        *_eval_table(summary),
        *[f"<h2>{path.stem.replace('_', ' ')}</h2><img src='{path.name}'>" for path in figures],
        *(["<h2>incidents</h2><pre>" + html.escape(timeline(incidents)) + "</pre>"] if incidents else []),
        "<h2>config</h2><pre>" + html.escape(config) + "</pre>",
        "</body></html>",
    ]
    write_output(index, "\n".join(page), overwrite=True)
    return Report(index, figures, summary, warnings)


def make_report(run_dir: str | Path) -> Path:
    """Write the plots and `index.html` into RUN_DIR/report; returns the index path."""
    return build_report(run_dir).index


def _config_text(path: Path) -> str:
    """The run config as the page shows it: a JSON document of at most 4 MiB (`zaya.reading`), indented."""
    if not exists(path):
        return "{}"
    return json.dumps(read_json(path, "config", "a run config"), indent=2)


def _report_dir(out: Path) -> Path:
    """RUN_DIR/report, made if missing; never a link (the plots would be written wherever it points)."""
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        try:
            out.mkdir()
        except OSError as exc:
            if storage_error(exc) is not None:
                raise
            raise ZayaError(f"{out}: cannot create ({os_reason(exc)})") from None
        return out
    except OSError as exc:
        raise ZayaError(f"{out}: cannot write ({os_reason(exc)})") from None
    if stat.S_ISLNK(info.st_mode):
        raise ZayaError(f"{out}: a symbolic link; refusing to write the report through it")
    if not stat.S_ISDIR(info.st_mode):
        raise ZayaError(f"{out}: exists and is not a directory; refusing to write the report there")
    return out


def _summary_table(summary: Summary) -> str:
    cells = "".join(f"<tr><th>{html.escape(label)}</th><td>{html.escape(text)}</td></tr>"
                    for label, text in summary_rows(summary))
    return f"<table class='summary'>{cells}</table>"


def _eval_table(summary: Summary) -> list[str]:
    rows = eval_rows(summary)
    if not rows:
        return []
    head = "".join(f"<th>{name}</th>" for name in EVAL_HEADER)
    body = "".join(f"<tr><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>"
                   f"<td class='num'>{html.escape(value)}</td><td class='num'>{html.escape(step)}</td></tr>"
                   for task, metric, value, step in rows)
    return ["<h2>evaluations</h2>", f"<table class='evals'><tr>{head}</tr>{body}</table>"]
