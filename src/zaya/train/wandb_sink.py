"""Weights & Biases as an optional sink of the metrics rows (`logging.wandb = true`; the `wandb` extra).

One W&B run per run directory: its id is kept in RUN_DIR/wandb-id.txt and every start (a resume, a roll-back)
continues it with `resume="allow"`; W&B writes under RUN_DIR/wandb. The run's config is the run config as
resolved (what run_config.json holds). The mode (online, offline, disabled) is `logging.wandb_mode`, else the
`WANDB_MODE` the `zaya` command was started with, else online.

Each metrics row is logged at `step=row["step"]`, so W&B's own step is the training step:

- scalars as they are (booleans as 0/1, strings such as `phase` as text; `time` is left out: W&B stamps rows);
- per-layer lists as one scalar per layer, `expert_imbalance/layer_3`, `router_entropy/layer_3`: a chart per
  layer that can be compared across runs, which a histogram over the layers would not give (it loses which
  layer is which); per-layer lists of lists (`expert_load`, layers x experts) as one histogram per layer,
  `expert_load/layer_3`, the spread of the experts' shares (balanced: every expert at 1/E);
- per-rank lists (`peak_memory_bytes`, `comm_bytes`, `host_time`) as `/max` and `/mean` over the ranks: the
  same keys whatever the world size.

W&B history only grows: a step at or below one it already has is refused, and rewinding a run (`resume_from`)
is a preview feature of the hosted service, not of self-managed servers, nor offline. So a resumed start
sends each row whose step W&B does not have yet: online, where W&B says which steps it has (`run.step`), the
rows a crash lost are logged again and the steps it had already received keep their first values (the same
values, as a resumed run replays its steps exactly on the CPU; after a loss-spike roll-back, the steps
before the spike as first trained); offline, where each start writes a new segment that knows nothing of the
earlier ones (`RUN_DIR/wandb/offline-run-*`), the rows up to the checkpoint are logged again from
`metrics.jsonl`, so that the newest segment holds the run's whole history: `wandb sync` it.
"""

from __future__ import annotations

import os
import secrets
import string
import sys
from pathlib import Path
from typing import Any

from zaya.errors import ZayaError
from zaya.owned import write_output
from zaya.reading import read_text
from zaya.run_dir import WANDB_ID_FILE
from zaya.schema import shown
from zaya.train.config import LoggingSection
from zaya.train.metrics import iter_metrics

PER_RANK = frozenset({"peak_memory_bytes", "comm_bytes", "host_time"})
LEFT_OUT = frozenset({"step", "time"})
IMAGE_PREFIX = "report/"


def import_wandb(source: str = "") -> Any:
    """The `wandb` module, or a one-line ZayaError (naming the config `source`) saying how to get it (or to
    switch it off)."""
    try:
        import wandb
    except ImportError:
        where = f"{source}: " if source else ""
        raise ZayaError(f"{where}logging.wandb = true needs the wandb package: pip install 'zaya-stack[wandb]', "
                        "or set logging.wandb = false") from None
    return wandb


def check_wandb(logging: LoggingSection, source: str = "") -> None:
    """Fail before anything starts if the config asks for W&B and it cannot be imported."""
    if logging.wandb:
        import_wandb(source)


def wandb_mode(logging: LoggingSection, environ_mode: str = "") -> str:
    """logging.wandb_mode, else the environment's WANDB_MODE (`environ_mode`), else "online"."""
    return logging.wandb_mode or environ_mode or "online"


class WandbSink:
    """Logs metrics rows to one W&B run, each step once and in increasing order (see the module docstring)."""

    def __init__(self, run: Any, wandb: Any, next_step: int = 0):
        self.run = run
        self._wandb = wandb
        self.next_step = next_step  # the lowest step W&B still accepts
        self.logged = 0  # rows this sink logged
        self.last_step: int | None = None  # the last step this sink logged

    def log(self, row: dict[str, Any]) -> bool:
        """Log one metrics row (JSON values, as in metrics.jsonl) at its step; False if W&B has that step."""
        step = row.get("step")
        if not isinstance(step, int) or step < self.next_step:
            return False
        self.run.log(wandb_row(row, self._wandb), step=step)
        self.next_step, self.last_step = step + 1, step
        self.logged += 1
        return True

    def log_images(self, images: dict[str, Path]) -> None:
        """Images (name -> PNG path) at the last step this sink logged, as `report/<name>`; nothing if it logged
        no row (a start with nothing left to train: the earlier start sent them)."""
        if self.last_step is None or not images:
            return
        self.run.log({IMAGE_PREFIX + name: self._wandb.Image(str(path)) for name, path in images.items()},
                     step=self.last_step)

    def close(self, exit_code: int | None = None) -> None:
        """Finish the W&B run: exit code 0 marks it finished, any other failed; None: that of the exception being
        raised, if any (called from a `finally`, it sees the exception in flight; SystemExit has its own code)."""
        if exit_code is None:
            error = sys.exc_info()[1]
            exit_code = 0 if error is None else 1
            if isinstance(error, SystemExit):
                exit_code = error.code if isinstance(error.code, int) else 1
        self.run.finish(exit_code=exit_code)


def wandb_row(row: dict[str, Any], wandb: Any) -> dict[str, Any]:
    """A metrics row as W&B values: scalars, per-layer scalars and histograms, per-rank max and mean."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key in LEFT_OUT or value is None:
            continue
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float, str)):
            out[key] = value
        elif isinstance(value, list) and value:
            numeric = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if key in PER_RANK and numeric:
                out[f"{key}/max"] = max(numeric)
                out[f"{key}/mean"] = sum(numeric) / len(numeric)
            elif all(isinstance(v, list) for v in value):
                for layer, shares in enumerate(value):
                    if shares:
                        out[f"{key}/layer_{layer}"] = wandb.Histogram(shares)
            else:
                for layer, v in enumerate(value):
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        out[f"{key}/layer_{layer}"] = v
    return out


def run_id(run_dir: Path) -> str:
    """The run directory's W&B run id, made and saved (atomically) on first use."""
    path = Path(run_dir) / WANDB_ID_FILE
    if os.path.lexists(path):
        saved = read_text(path, "pointer", "a W&B run id file").strip()
        if not saved or len(saved) > 128 or not saved.isprintable() or any(c in saved for c in "/\\#?%: \t"):
            raise ZayaError(f"{path}: not a W&B run id ({shown(saved)}); delete the file to start a new W&B run")
        return saved
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    write_output(path, new + "\n", overwrite=False)
    return new


def open_wandb(run_dir: Path, logging: LoggingSection, record: dict, start_step: int,
               environ_mode: str = "") -> WandbSink | None:
    """The W&B sink of a run that starts (or resumes) at `start_step`, with the run config `record`, or None
    without `logging.wandb` (or in mode "disabled": `wandb_mode` with the environment's WANDB_MODE,
    `environ_mode`). Call it on rank 0 only. Raises a one-line ZayaError if wandb is missing or its init fails."""
    if not logging.wandb:
        return None
    wandb = import_wandb()
    mode = wandb_mode(logging, environ_mode)
    if mode == "disabled":
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    identity = run_id(run_dir)
    try:
        # create_new: leave any W&B run of the caller's alone (no global run is set or finished)
        run = wandb.init(project=logging.wandb_project, name=logging.wandb_name or run_dir.resolve().name,
                         id=identity, resume="allow", config=record, allow_val_change=True,
                         dir=str(run_dir), mode=mode, reinit="create_new")
    except wandb.errors.Error as exc:
        message = " ".join(str(exc).split())
        raise ZayaError(f"W&B could not start run {identity} of project {logging.wandb_project!r} ({mode}): "
                        f"{message}; run `wandb login`, or set logging.wandb_mode = 'offline'") from exc
    sink = WandbSink(run, wandb, next_step=max(0, int(run.step or 0)))
    if start_step > 0:
        for row in iter_metrics(run_dir):
            if row.get("step", 0) > start_step:
                break
            sink.log(row)
    return sink

