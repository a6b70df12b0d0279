"""`zaya report RUN_DIR`: PNG plots of a run's metrics and an `index.html` that shows them with its config.

    loss.png          training loss and held-out loss
    schedule.png      learning rate and global batch size
    throughput.png    tokens/s and MFU
    expert_load.png   heatmap of every layer's expert load (fraction of tokens) over time

and the incident timeline of the run (the trainer's and the supervisor's `incidents.jsonl`), if it has one.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from zaya.errors import ZayaError
from zaya.resilience.incidents import FILE as INCIDENTS_FILE
from zaya.resilience.incidents import read_incidents, timeline
from zaya.train.metrics import read_metrics

REPORT_DIR = "report"


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(row["step"])
            values.append(value)
    return steps, values


def _line_plot(path: Path, title: str, panels: list[list[tuple[str, tuple[list, list]]]], ylabels: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    for ax, lines, ylabel in zip(axes[:, 0], panels, ylabels, strict=True):
        for label, (xs, ys) in lines:
            if xs:
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(series[0] for _, series in lines):
            ax.legend(loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _heatmap(path: Path, rows: list[dict]) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    loads = [(row["step"], row["expert_load"]) for row in rows if isinstance(row.get("expert_load"), list)]
    if not loads:
        return False
    steps = [step for step, _ in loads]
    grid = np.array([np.array(load, dtype=float).reshape(-1) for _, load in loads]).T  # [L * E, time]
    layers, experts = len(loads[0][1]), len(loads[0][1][0])
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.12 * layers * experts + 1.5)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(steps[0], steps[-1], layers * experts, 0))
    for layer in range(1, layers):
        ax.axhline(layer * experts, color="white", linewidth=0.8)
    ax.set_yticks([(layer + 0.5) * experts for layer in range(layers)], [f"layer {layer}" for layer in range(layers)])
    ax.set_xlabel("step")
    ax.set_title(f"expert load (fraction of tokens; balanced = {1 / experts:.3f})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def incident_files(path: Path) -> list[Path]:
    """The incident logs of a run directory or a supervisor state directory: its own and its supervisor's."""
    return [p for p in (path / INCIDENTS_FILE, path / "supervisor" / INCIDENTS_FILE) if p.is_file()]


def read_all_incidents(path: Path) -> list[dict]:
    """Every incident record under `path`, in time order."""
    records = [record for file in incident_files(Path(path)) for record in read_incidents(file)]
    return sorted(records, key=lambda record: record.get("time", ""))


def make_report(run_dir: str | Path) -> Path:
    """Write the plots and `index.html` into RUN_DIR/report; returns the index path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ZayaError(f"{run_dir}: no such run directory")
    rows = read_metrics(run_dir)
    if not rows:
        raise ZayaError(f"{run_dir}: no metrics.jsonl rows to report")
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    train = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval_loss" in row]
    losses = [("train", _series(train, "loss")), ("held-out", _series(evals, "eval_loss"))]
    _line_plot(out / "loss.png", "loss", [losses], ["cross-entropy (nats)"])
    schedule = [[("learning rate", _series(train, "lr"))], [("global batch", _series(train, "batch_size"))]]
    _line_plot(out / "schedule.png", "schedule", schedule, ["learning rate", "sequences"])
    _line_plot(out / "throughput.png", "throughput",
               [[("tokens/s", _series(train, "tokens_per_s"))], [("MFU", _series(train, "mfu"))]],
               ["tokens/s", "fraction of peak"])
    figures = ["loss.png", "schedule.png", "throughput.png"]
    if _heatmap(out / "expert_load.png", train):
        figures.append("expert_load.png")
    config_path = run_dir / "run_config.json"
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else "{}"
    last = train[-1] if train else {}
    summary = {
        "steps": last.get("step"),
        "tokens": last.get("tokens"),
        "final loss": last.get("loss"),
        "final held-out loss": evals[-1].get("eval_loss") if evals else None,
    }
    incidents = read_all_incidents(run_dir)
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>zaya run report</title>",
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}img{max-width:100%}"
        "pre{background:#f4f4f4;padding:1em;overflow:auto}</style></head><body>",
        f"<h1>Run report: {html.escape(run_dir.name)}</h1>",
        "<table>" + "".join(f"<tr><th align=left>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                            for k, v in summary.items()) + "</table>",
        *[f"<h2>{name[:-4].replace('_', ' ')}</h2><img src='{name}'>" for name in figures],
        *(["<h2>incidents</h2><pre>" + html.escape(timeline(incidents)) + "</pre>"] if incidents else []),
        "<h2>config</h2><pre>" + html.escape(json.dumps(json.loads(config_text), indent=2)) + "</pre>",
        "</body></html>",
    ]
    index = out / "index.html"
    index.write_text("\n".join(page), encoding="utf-8")
    return index
