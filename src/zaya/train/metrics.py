"""Training metrics: one JSON object per line in `metrics.jsonl`, the same scalars in TensorBoard, the rows
in an optional sink (Weights & Biases: zaya.train.wandb_sink), and a progress bar with loss, tokens/s and ETA.

On resume from step S the log is cut back to the rows of steps <= S (and TensorBoard purges later steps),
so that the loss curve of a resumed run is the curve of an uninterrupted one.

The progress bar counts steps to `total_steps`, or, for a run with a time budget (`progress_seconds` > 0),
seconds of training to the budget, so that its ETA is the time the run has left.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from tqdm import tqdm

from zaya.errors import ZayaError
from zaya.reading import open_regular, os_reason
from zaya.run_dir import METRICS_FILE, TENSORBOARD_DIR, open_append
from zaya.schema import is_a

# the seconds bar: no rate (it would read "1.00s/s"); the step goes in the postfix
SECONDS_BAR = "{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]"


ROW_CAP = 16 << 20  # a metrics row longer than this is not one of ours (the largest model's rows are ~1 MB)


def iter_metrics(run_dir: Path) -> Iterator[dict]:
    """The rows of a run's metrics log, one at a time, each line read with a bound (a torn last line, from a crash
    mid-write, ends them). None of it if the log is missing; one `ZayaError` if it is not a regular file or not a
    metrics log."""
    path = Path(run_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return
    with open_regular(path, "a metrics log") as handle:
        for row, _ in _rows(handle, path):
            if row is None:
                break
            yield row


def read_metrics(run_dir: Path) -> list[dict]:
    """All rows of a run's metrics log (`iter_metrics`)."""
    return list(iter_metrics(run_dir))


def _rows(handle: BinaryIO, path: Path) -> Iterator[tuple[dict | None, int]]:
    """(row, offset of its line) for each line of a metrics log; the row is None where the line is not one (not
    JSON, not an object with an integer step, longer than `ROW_CAP`). A log whose first line is none is no log."""
    offset, first = 0, True
    while line := handle.readline(ROW_CAP + 1):
        start, offset = offset, offset + len(line)
        row = None
        if len(line) > ROW_CAP and not line.endswith(b"\n"):
            while (rest := handle.readline(ROW_CAP + 1)) and not rest.endswith(b"\n"):
                offset += len(rest)
            offset += len(rest)
        else:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
                row = None
            if not isinstance(row, dict) or not is_a(row.get("step", 0), int):
                row = None
        if row is None and first and line.strip():
            raise ZayaError(f"{path}: not a metrics log (its first line is not a JSON object)")
        first = False
        yield row, start


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep the rows of steps <= `last_step`: the log is cut at the first row past it (or the first line that is no
    row), in place; the rows' steps rise through the log, as every start cuts it so."""
    path = Path(run_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot rewrite the metrics log ({os_reason(exc)})") from None
    with os.fdopen(fd, "r+b") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ZayaError(f"{path}: not a regular file; refusing to rewrite it as the metrics log")
        os.set_blocking(fd, True)
        cut = None
        for row, start in _rows(handle, path):
            if row is None or row.get("step", 0) > last_step:
                cut = start
                break
        if cut is not None:
            handle.truncate(cut)
            handle.flush()
            os.fsync(fd)


class Sink(Protocol):
    """Where metrics rows also go (`zaya.train.wandb_sink.WandbSink`)."""

    def log(self, row: dict[str, Any]) -> bool: ...

    def log_images(self, images: dict[str, Path]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Writes metric rows to `metrics.jsonl`, TensorBoard and the sink (rank 0 only) and drives the progress bar.

    `sink` (a WandbSink, or None) is owned from here on: `close()` closes it."""

    def __init__(self, run_dir: Path, *, start_step: int, total_steps: int, tensorboard: bool, progress: bool,
                 enabled: bool = True, sink: Sink | None = None, progress_seconds: float = 0.0,
                 seconds_done: float = 0.0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._file = None
        self._writer = None
        self._bar = None
        self._sink = sink
        self._seconds = progress_seconds > 0
        if not enabled:
            return
        truncate_metrics(self.run_dir, start_step)
        self._file = open_append(self.run_dir / METRICS_FILE)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)
        if progress and self._seconds:
            self._bar = tqdm(total=progress_seconds, initial=min(seconds_done, progress_seconds), unit="s",
                             bar_format=SECONDS_BAR, dynamic_ncols=True, disable=None, leave=True)
        elif progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             disable=None, leave=True)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row (it must carry `step`); non-finite floats are written as null."""
        if not self.enabled:
            return
        clean = {key: _jsonable(value) for key, value in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, clean["step"])
                elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                    self._writer.add_histogram(key, torch.tensor(value, dtype=torch.float64), clean["step"])
        if self._sink is not None:
            self._sink.log(clean)

    def progress(self, step: int, postfix: dict[str, str], seconds: float | None = None) -> None:
        """Move the bar to `step`, or with a time budget to `seconds` of training (the step then leads the
        postfix)."""
        if self._bar is None:
            return
        if self._seconds:
            if seconds is not None:
                self._bar.n = min(float(seconds), self._bar.total)
            postfix = {"step": f"{step:,}", **postfix}
        else:
            self._bar.n = step
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    @property
    def shows_bar(self) -> bool:
        """Whether a progress bar is on the screen (tqdm leaves it off where the output is not a terminal)."""
        return self._bar is not None and not self._bar.disable

    def message(self, text: str) -> None:
        """A line of text above the progress bar (or on stderr without one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            tqdm.write(text)

    def finish(self, plots: Callable[[], dict[str, Path]]) -> None:
        """At the end of a run: the report's plots (`plots()`, name -> PNG, made only with a sink) to the sink, as
        images. A failure to plot (matplotlib missing, say) is reported in one line and never fails the run."""
        if not self.enabled or self._sink is None:
            return
        try:
            self._sink.log_images(plots())
        except ImportError as exc:
            self.message(f"W&B: no report plots ({exc})")
        except Exception as exc:  # the run itself is done and saved: neither a plot nor its upload may fail it
            self.message(f"W&B: the report plots failed ({type(exc).__name__}: {exc}); training is unaffected")

    def close(self) -> None:
        """Close the bar, TensorBoard, the log and the sink (which marks its run failed if an exception is being
        raised)."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
