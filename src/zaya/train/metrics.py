"""Training metrics: one JSON object per line in `metrics.jsonl`, the same scalars in TensorBoard, and a
progress bar with loss, tokens/s and ETA.

On resume from step S the log is cut back to the rows of steps <= S (and TensorBoard purges later steps),
so that the loss curve of a resumed run is the curve of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: Path) -> list[dict]:
    """All rows of a run's metrics log (a torn last line, from a crash mid-write, is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep the rows of steps <= `last_step` (atomically: a crash leaves either the old or the new log)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    rows = [row for row in read_metrics(run_dir) if row.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class MetricsLogger:
    """Writes metric rows to `metrics.jsonl` and TensorBoard (rank 0 only) and drives the progress bar."""

    def __init__(self, run_dir: Path, *, start_step: int, total_steps: int, tensorboard: bool, progress: bool,
                 enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._file = None
        self._writer = None
        self._bar = None
        if not enabled:
            return
        truncate_metrics(self.run_dir, start_step)
        self._file = (self.run_dir / METRICS_FILE).open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
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

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.refresh()

    def message(self, text: str) -> None:
        """A line of text above the progress bar (or on stderr without one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            tqdm.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
