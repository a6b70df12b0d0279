"""`zaya eval --tasks`: lm-evaluation-harness tasks on a zaya model, the results JSON and the run's record.

The results (lm_eval's own JSON, as `lm_eval --output_path` would write it, without samples) go to
`RUN_DIR/evals/lm_eval-step_<step>-<time>.json` when the model is a run directory or a checkpoint inside
one, beside the model directory otherwise, or to `--output FILE`; a run also gets one summary line in
`RUN_DIR/evals.jsonl` (`zaya.evals.records`).
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zaya.errors import ZayaError
from zaya.evals.records import (
    append_record,
    check_record_file,
    checkpoint_step,
    lm_eval_record,
    run_dir_of,
    task_metrics,
)
from zaya.owned import check_output, make_parent, write_output
from zaya.reading import CAPS, os_reason, size_text
from zaya.run_dir import EVALS_DIR

INSTALL_HINT = "pip install 'zaya-stack[eval]'"


@dataclass(frozen=True)
class TaskRun:
    """What `zaya eval --tasks` runs: lm_eval task names (or YAML paths) on the model at `model`."""

    model: Path
    tasks: tuple[str, ...]
    include_path: Path | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    device: str | None = None
    output: Path | None = None
    overwrite: bool = False  # replace an existing `output` file (never a link, FIFO, device or directory)


@dataclass(frozen=True)
class TaskRunResult:
    """lm_eval's results, their summary ({task: {metric: value}}), where the JSON went and the run's
    evals.jsonl (None outside a run)."""

    results: dict
    summary: dict[str, dict[str, float]]
    results_file: Path
    record_file: Path | None


def import_lm_eval() -> Any:
    """The lm_eval package, or one line saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise ZayaError(f"lm-evaluation-harness is not installed: {INSTALL_HINT}") from None
    return lm_eval


def parse_tasks(text: str) -> tuple[str, ...]:
    """'a,b , c' -> ('a', 'b', 'c'); an empty list is an error."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise ZayaError("--tasks is empty; give task names separated by commas")
    return names


def task_manager_for(tasks: tuple[str, ...], include_path: Path | None) -> Any:
    """An lm_eval TaskManager that knows every name in `tasks`, or one line naming those it does not know."""
    import_lm_eval()
    if include_path is not None:
        if not include_path.is_dir():
            raise ZayaError(f"{include_path}: --include-path is not a directory")
        check_task_files(include_path)
    for name in tasks:  # a task given as a YAML path
        if os.path.lexists(name):
            _check_task_file(Path(name))
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        # indexing lm_eval's own thousands of tasks takes about half a minute; local tasks need only theirs
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if not _unknown(local, tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = _unknown(manager, tasks)
    if unknown:
        where = f" (lm_eval's and those in {include_path})" if include_path is not None else ""
        raise ZayaError(f"unknown lm_eval task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not among the "
                        f"{len(manager.all_tasks)} known tasks{where}; `lm_eval ls tasks` lists them")
    return manager


def run_tasks(run: TaskRun, *, task_manager: Any = None) -> TaskRunResult:
    """Evaluate the model on the tasks with the native `zaya` lm_eval model, write the results JSON and, for a
    model inside a run directory, append its evals.jsonl line."""
    lm_eval = import_lm_eval()
    run_dir = run_dir_of(run.model)
    step = checkpoint_step(run.model)
    # where the results go is checked before the evaluation (minutes to hours), and again as they are written
    results_file = run.output or _results_path(run.model, run_dir, step)
    check_output(results_file, run.overwrite if run.output else False)
    if run_dir is not None:
        check_record_file(run_dir)
    make_parent(results_file)
    manager = task_manager or task_manager_for(run.tasks, run.include_path)
    from lm_eval.utils import handle_non_serializable

    from zaya.evals.harness import ZayaLM

    lm = ZayaLM(path=str(run.model), device=run.device, batch_size=run.batch_size)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=list(run.tasks), num_fewshot=run.num_fewshot,
                                          limit=run.limit, task_manager=manager, log_samples=False)
    except FileNotFoundError as exc:  # a task's data_files that do not exist (resolved against the cwd)
        raise ZayaError(f"lm_eval: {str(exc).splitlines()[0]}") from None
    except ConnectionError as exc:  # a task's dataset on the Hub, offline or unreachable (datasets' own type)
        raise ZayaError(f"lm_eval: {str(exc).splitlines()[0]}; the task's data must be downloaded first (it is "
                        "cached under HF_DATASETS_CACHE), or given as local files with --include-path") from None
    write_output(results_file, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
                 + "\n", run.overwrite if run.output else False)
    record_file = None
    if run_dir is not None:
        relative = os.path.relpath(results_file.resolve(), run_dir.resolve())
        record = lm_eval_record(run.model, step, results, run.num_fewshot, run.limit, relative)
        record_file = append_record(run_dir, record)
    return TaskRunResult(results=results, summary=task_metrics(results), results_file=results_file,
                         record_file=record_file)


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    """A short table: one row per task and metric."""
    rows = [(task if i == 0 else "", metric, f"{value:.4f}")
            for task, metrics in summary.items() for i, (metric, value) in enumerate(metrics.items())]
    header = ("task", "metric", "value")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}".rstrip() for a, b, c in [header, *rows])


def _unknown(manager: Any, tasks: tuple[str, ...]) -> list[str]:
    return [name for name in tasks if not manager.match_tasks([name]) and not Path(name).is_file()]


def _results_path(model: Path, run_dir: Path | None, step: int | None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    name = f"lm_eval-{f'step_{step:08d}-' if step is not None else ''}{stamp}"
    if run_dir is not None:
        base = _evals_dir(run_dir / EVALS_DIR) / name
    else:
        base = model.resolve().parent / f"{model.resolve().name}.{name}"
    path, n = base.with_name(base.name + ".json"), 1
    while os.path.lexists(path):  # two runs in one second (a dangling link counts: never written through)
        path, n = base.with_name(f"{base.name}-{n}.json"), n + 1
    return path


def _evals_dir(path: Path) -> Path:
    """RUN_DIR/evals, made if missing; a link or anything but a directory there is refused."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path  # made with the results file (`make_parent`)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot write ({os_reason(exc)})") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise ZayaError(f"{path}: {what}; refusing to write evaluation results there")
    return path


TASK_FILE_CAP = CAPS["config"]  # a task YAML: lm_eval reads each whole
TASK_FILES = 10_000  # YAML files under an --include-path that lm_eval would index


def check_task_files(include_path: Path) -> None:
    """Every YAML file lm_eval will read under `include_path` (it indexes `**/*.yaml`, without following links to
    directories) must be a regular file of at most 4 MiB: lm_eval opens them blocking and reads them whole, so a
    FIFO would hang it and /dev/zero fill the memory."""
    try:
        for count, path in enumerate(include_path.glob("**/*.yaml"), 1):
            if count > TASK_FILES:
                raise ZayaError(f"{include_path}: more than {TASK_FILES:,} task YAML files under --include-path")
            _check_task_file(path)
    except OSError as exc:
        raise ZayaError(f"{include_path}: cannot list the task files ({os_reason(exc)})") from None
    except RecursionError:
        raise ZayaError(f"{include_path}: directories nested too deep under --include-path") from None


def _check_task_file(path: Path) -> None:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read the task file ({os_reason(exc)})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ZayaError(f"{path}: not a regular file; a task YAML must be one")
    if info.st_size > TASK_FILE_CAP:
        raise ZayaError(f"{path}: larger than {size_text(TASK_FILE_CAP)}, the limit for a task YAML")
