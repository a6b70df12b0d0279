"""Where a model's evaluation results go: its run directory, and the run's `evals.jsonl`.

`RUN_DIR/evals.jsonl` has one JSON object per evaluation, appended (never rewritten), for `zaya report`:

    {"time": 1764620000.0, "step": 300, "model": "runs/tiny", "kind": "lm_eval",
     "tasks": {"hellaswag": {"acc": 0.31, "acc_norm": 0.35}}, "num_fewshot": null, "limit": 100,
     "results_file": "evals/lm_eval-step_00000300-20261201T120000.json"}
    {"time": 1764620100.0, "step": 300, "model": "runs/tiny", "kind": "heldout", "data": "data/stdlib",
     "split": "val", "seq_len": 512, "max_batches": null, "loss": 2.91, "ppl": 18.4}

`step` is the checkpoint's training step (null for a model that has none, e.g. an imported HF directory). A
record says what was evaluated as well as the result: evaluating a checkpoint again (a rerun of the same
commands) appends another record of the same evaluation, and `zaya report` shows the newest of them.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path

from zaya import checkpoint
from zaya.errors import ZayaError, storage_error
from zaya.reading import os_reason
from zaya.run_dir import CHECKPOINTS_DIR, EVALS_FILE, append_fd
from zaya.weights import model_dir_kind, resolve_model_dir


def run_dir_of(model_path: str | Path) -> Path | None:
    """The run directory a model belongs to: the model path itself if it is a run directory, the run that
    holds a checkpoint in its `checkpoints/`, else None (an HF directory, a checkpoint on its own)."""
    path = Path(model_path)
    kind = model_dir_kind(path)
    if kind == "run":
        return path.parent if path.name == CHECKPOINTS_DIR else path
    if kind == "checkpoint" and path.resolve().parent.name == CHECKPOINTS_DIR:
        return path.resolve().parent.parent
    return None


def checkpoint_step(model_path: str | Path) -> int | None:
    """The training step of the checkpoint a model path loads (None for an HF directory or a converted one)."""
    directory, kind = resolve_model_dir(model_path)
    if kind != "checkpoint":
        return None
    step = checkpoint.read_json(directory / checkpoint.INFO_FILE).get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    match = checkpoint.STEP_DIR.fullmatch(directory.name)
    return int(match.group(1)) if match else None


def check_record_file(run_dir: Path) -> None:
    """Refuse, before an evaluation, an evals.jsonl that `append_record` would refuse after it: anything but a
    regular file (a link, a FIFO, a directory)."""
    path = Path(run_dir) / EVALS_FILE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ZayaError(f"{path}: cannot append ({os_reason(exc)})") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise ZayaError(f"{path}: {what}; refusing to append to it")


def append_record(run_dir: Path, record: dict) -> Path:
    """Append one line to RUN_DIR/evals.jsonl (the line is written with a single write, so readers never
    see half of it); returns the file's path."""
    path = Path(run_dir) / EVALS_FILE
    check_record_file(run_dir)
    line = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
    try:
        # never through a link, never blocking on a FIFO (`append_fd`); one write, so readers never see half
        fd = append_fd(path)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if storage_error(exc) is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise ZayaError(f"{path}: cannot append ({os_reason(exc)})") from None
    return path


def heldout_record(model_path: str | Path, step: int | None, split: str, seq_len: int, loss: float, *,
                   data: str | Path | None = None, max_batches: int | None = None) -> dict:
    """The evals.jsonl line of a held-out loss evaluation (`zaya eval --data`): of the dataset `data` (as given),
    its first `max_batches` batches (None: the whole split)."""
    return {"time": time.time(), "step": step, "model": str(model_path), "kind": "heldout",
            "data": None if data is None else str(data), "split": split, "seq_len": seq_len,
            "max_batches": max_batches, "loss": loss, "ppl": math.exp(min(loss, 700.0))}


def lm_eval_record(model_path: str | Path, step: int | None, results: dict, num_fewshot: int | None,
                   limit: int | None, results_file: str) -> dict:
    """The evals.jsonl line of an lm_eval run: every task's (and group's) metrics without their stderr."""
    return {"time": time.time(), "step": step, "model": str(model_path), "kind": "lm_eval",
            "tasks": task_metrics(results), "num_fewshot": num_fewshot, "limit": limit, "results_file": results_file}


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm_eval's results: the key "acc,none" becomes "acc" and "acc,<filter>"
    stays as it is; stderr entries and values that are not numbers are left out."""
    tasks: dict[str, dict[str, float]] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            metrics = tasks.setdefault(task, {})
            for key, value in values.items():
                if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                metric, filter_name = key.split(",", 1)
                if metric.endswith("_stderr") or not math.isfinite(value):
                    continue
                metrics[metric if filter_name == "none" else key] = float(value)
    return tasks
