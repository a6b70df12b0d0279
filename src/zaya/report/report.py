"""`zaya report RUN_DIR`: PNG plots of a run's metrics and an `index.html` that shows them with a summary at
the top (zaya.report.summary: steps, tokens, time, losses, throughput, memory, evaluations, warnings), the incident
timeline of the run (the trainer's and the supervisor's `incidents.jsonl`), if it has one, and its config.
Every number on the page is formatted for people (zaya.report.numbers).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from zaya.errors import ZayaError
from zaya.report.plots import write_plots
from zaya.report.summary import EVAL_HEADER, Summary, eval_rows, read_evals, summarize, summary_rows
from zaya.resilience.incidents import read_incidents, timeline
from zaya.run_dir import INCIDENTS_FILE, REPORT_DIR, RUN_CONFIG_FILE, SUPERVISOR_DIR
from zaya.train.metrics import read_metrics

STYLE = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}img{max-width:100%}"
         "pre{background:#f4f4f4;padding:1em;overflow:auto}table{border-collapse:collapse;margin-bottom:1em}"
         "th,td{padding:0.15em 0.8em;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}"
         "tr:nth-child(even){background:#f7f7f7}")


@dataclass
class Report:
    index: Path  # RUN_DIR/report/index.html
    figures: list[Path]  # the PNG plots, in the page's order
    summary: Summary


def incident_files(path: Path) -> list[Path]:
    """The incident logs of a run directory or a supervisor state directory: its own and its supervisor's."""
    return [p for p in (path / INCIDENTS_FILE, path / SUPERVISOR_DIR / INCIDENTS_FILE) if p.is_file()]


def read_all_incidents(path: Path) -> list[dict]:
    """Every incident record under `path`, in time order."""
    records = [record for file in incident_files(Path(path)) for record in read_incidents(file)]
    return sorted(records, key=lambda record: record.get("time", ""))


def build_report(run_dir: str | Path) -> Report:
    """Write the plots and `index.html` into RUN_DIR/report; returns where they are and the summary."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ZayaError(f"{run_dir}: no such run directory")
    rows = read_metrics(run_dir)
    if not rows:
        raise ZayaError(f"{run_dir}: no metrics.jsonl rows to report")
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    figures = write_plots(rows, out)
    incidents = read_all_incidents(run_dir)
    summary = summarize(rows, read_evals(run_dir), incidents)
    config_path = run_dir / RUN_CONFIG_FILE
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else "{}"
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>zaya run report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Run report: {html.escape(run_dir.name)}</h1>",
        _summary_table(summary),
        *_eval_table(summary),
        *[f"<h2>{path.stem.replace('_', ' ')}</h2><img src='{path.name}'>" for path in figures],
        *(["<h2>incidents</h2><pre>" + html.escape(timeline(incidents)) + "</pre>"] if incidents else []),
        "<h2>config</h2><pre>" + html.escape(json.dumps(json.loads(config_text), indent=2)) + "</pre>",
        "</body></html>",
    ]
    index = out / "index.html"
    index.write_text("\n".join(page), encoding="utf-8")
    return Report(index, figures, summary)


def make_report(run_dir: str | Path) -> Path:
    """Write the plots and `index.html` into RUN_DIR/report; returns the index path."""
    return build_report(run_dir).index


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
