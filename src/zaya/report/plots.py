"""The report's PNG plots of a run's metrics rows (matplotlib, drawn off-screen):

    loss.png          training loss and held-out loss
    schedule.png      learning rate and global batch size
    throughput.png    tokens/s and MFU
    expert_load.png   heatmap of every layer's expert load (fraction of tokens) over time
"""

from __future__ import annotations

import io
from pathlib import Path

from zaya.owned import write_output

MAX_HEIGHT_IN = 60.0  # inches of the heatmap (6,000 pixels): rows of many layers x experts get thinner
FIGURES = ("loss.png", "schedule.png", "throughput.png", "expert_load.png")  # every file `write_plots` may write


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PLOT_LIMIT = 1e18  # values beyond it (1e308 tokens/s) are left out of a plot: matplotlib's ticks overflow on them


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= PLOT_LIMIT:
            steps.append(row["step"])
            values.append(value)
    return steps, values


def _count_tick(value: float, _position) -> str:
    """An axis tick with thousands separators (12,000), keeping the decimals of small ticks (2.5)."""
    return f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:,g}"


def _line_plot(path: Path, title: str, panels: list[list[tuple[str, tuple[list, list]]]], ylabels: list[str],
               formats: list[str | None]) -> None:
    """`formats` per panel: None, "count" (thousands separators) or "percent" (fractions as percentages)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

    counts = FuncFormatter(_count_tick)

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    for ax, lines, ylabel, form in zip(axes[:, 0], panels, ylabels, formats, strict=True):
        for label, (xs, ys) in lines:
            if xs:
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if form == "count":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_formatter(counts)
        elif form == "percent":
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        if any(series[0] for _, series in lines):
            ax.legend(loc="best")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].xaxis.set_major_formatter(counts)
    fig.suptitle(title)
    _save(plt, fig, path)


def _heatmap(path: Path, rows: list[dict]) -> bool:
    plt = _pyplot()
    import numpy as np

    loads = [(row["step"], np.asarray(row["expert_load"], dtype=np.float32)) for row in rows
             if row.get("expert_load") is not None]
    if not loads or len({load.shape for _, load in loads}) != 1 or np.asarray(loads[0][1]).ndim != 2:
        return False  # (`zaya.report.logs` keeps one shape; rows made by hand may mix them)
    steps = [step for step, _ in loads]
    grid = np.stack([load.reshape(-1) for _, load in loads]).T  # [L * E, time]
    layers, experts = loads[0][1].shape
    fig, ax = plt.subplots(figsize=(9, min(MAX_HEIGHT_IN, max(3.0, 0.12 * layers * experts + 1.5))))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(steps[0], steps[-1], layers * experts, 0))
    for layer in range(1, layers):
        ax.axhline(layer * experts, color="white", linewidth=0.8)
    ax.set_yticks([(layer + 0.5) * experts for layer in range(layers)], [f"layer {layer}" for layer in range(layers)])
    ax.set_xlabel("step")
    ax.set_title(f"expert load (fraction of tokens; balanced = {1 / experts:.3f})")
    fig.colorbar(image, ax=ax)
    _save(plt, fig, path)
    return True


def _save(plt, fig, path: Path) -> None:
    """The figure as a PNG at `path`, replacing a file there (the report's own) but never a link, a FIFO or a
    directory: matplotlib would write through them."""
    try:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    write_output(path, buffer.getvalue(), overwrite=True)


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    """Draw the plots of `rows` into `out`; returns their paths, in the report's order."""
    train = [row for row in rows if "loss" in row]
    evals = [row for row in rows if "eval_loss" in row]
    losses = [("train", _series(train, "loss")), ("held-out", _series(evals, "eval_loss"))]
    _line_plot(out / "loss.png", "loss", [losses], ["cross-entropy (nats)"], [None])
    schedule = [[("learning rate", _series(train, "lr"))], [("global batch", _series(train, "batch_size"))]]
    _line_plot(out / "schedule.png", "schedule", schedule, ["learning rate", "sequences"], [None, "count"])
    _line_plot(out / "throughput.png", "throughput",
               [[("tokens/s", _series(train, "tokens_per_s"))], [("MFU", _series(train, "mfu"))]],
               ["tokens/s", "MFU (of peak)"], ["count", "percent"])
    figures = [out / "loss.png", out / "schedule.png", out / "throughput.png"]
    if _heatmap(out / "expert_load.png", train):
        figures.append(out / "expert_load.png")
    return figures
