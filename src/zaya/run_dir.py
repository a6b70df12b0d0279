"""The files of a run directory, by name: what the trainer writes and `zaya report`, `zaya eval` and the
supervisor read.

    run_config.json        the run config as resolved (every default, `--set` and `auto` decided)
    train.log              rank 0's messages; logs/rank-R.log the other ranks'
    metrics.jsonl          one row per logged step (zaya.train.metrics)
    samples.jsonl          with logging.record_samples: the global positions each step trained on
    incidents.jsonl        every decision on the training signals (zaya.resilience.incidents)
    evals.jsonl, evals/    evaluation results (zaya.evals.records)
    checkpoints/           step_N/ and `latest` (zaya.checkpoint)
    tensorboard/, wandb/, wandb-id.txt, report/, supervisor/

The logs are appended through `open_append`, which writes only to a regular file of that name (never through a link
planted there, never to a FIFO or a device).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TextIO

from zaya.errors import ZayaError

RUN_CONFIG_FILE = "run_config.json"  # not config.json: that name marks a Hugging Face directory
CONFIG_HISTORY_FILE = "config_history.jsonl"  # what each resume changed in the run's settings
INIT_FROM_FILE = "init_from.json"  # the weights a run started from (train.init_from) and their fingerprint
LOG_FILE = "train.log"
RANK_LOG = "logs/rank-{}.log"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
INCIDENTS_FILE = "incidents.jsonl"
EVALS_FILE = "evals.jsonl"
EVALS_DIR = "evals"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-id.txt"
REPORT_DIR = "report"
SUPERVISOR_DIR = "supervisor"


def open_append(path: Path | str) -> TextIO:
    """`path` opened to append text, created if missing: a file of zaya's own, so never through a symbolic link
    planted at its name, and never a FIFO (which would block) or a device; either is one `ZayaError`."""
    return os.fdopen(append_fd(path), "a", encoding="utf-8")


def append_fd(path: Path | str) -> int:
    """`open_append`'s descriptor, for one `os.write` of a whole record. Another error of the open (no
    permission, a full disk) is the `OSError` itself, for the caller to name."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ZayaError(f"{path}: a symbolic link; zaya appends only to a file of its own") from None
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise ZayaError(f"{path}: a FIFO, not a file of zaya's; refusing to write to it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ZayaError(f"{path}: not a regular file; refusing to write to it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
