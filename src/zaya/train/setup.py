"""What the trainer is given besides the resolved run (`TrainerSetup`): where it writes and runs, what it resumes
or starts from, the supervisor's policy, and what the outside installs in it (hooks, clocks, the plan's
forecast, the report's plots). `zaya train` fills it in from the job and its environment (`zaya.training`); a
test may replace any field."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from zaya.locking import DirectoryLock
from zaya.parallel.launch import Launch
from zaya.resilience.policy import Policy
from zaya.train.hooks import Hooks
from zaya.weights import WeightSource


class Forecast(Protocol):
    """The plan beside the run (`zaya.plan.forecast`): a prediction at the start, the measurement beside it."""

    def start(self, phase: int) -> str: ...

    def observe(self, row: dict) -> str | None: ...


@dataclass
class TrainerSetup:
    """See the module docstring."""

    run_dir: Path
    launch: Launch = field(default_factory=Launch)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    resume_from: Path | None = None  # the newest valid checkpoint (`zaya.train.inputs.newest_checkpoint`)
    init_from: WeightSource | None = None  # the weights a fresh run starts from (`zaya.train.inputs.init_source`)
    notes: list[str] = field(default_factory=list)  # what the start-up checks found worth saying (rank 0 says it)
    allow_data_change: bool = False  # resume even though the data (or its order) changed
    peak_flops: tuple[float, str] | None = None  # (FLOP/s of one device, where it came from); None: measured
    policy: Policy = field(default_factory=Policy)  # the supervisor's, for the training signals
    incidents_file: Path | None = None  # None: RUN_DIR/incidents.jsonl
    run_attempt: int = 0  # the supervisor's restart count, for incident records
    hooks: Hooks = field(default_factory=Hooks)  # heartbeats, fault injection
    origin: float = field(default_factory=time.time)  # what train.max_time_s counts from, by `clock`
    started: float | None = None  # this process's start by `clock`, for train.time_budget_s; None: the trainer's
    # the stop rules' clocks: the wall clock (deadlines) and the timer of steps and saves (their durations feed
    # train.max_time_s and a time budget); tests give both a clock of their own
    clock: Callable[[], float] = time.time
    timer: Callable[[], float] = time.perf_counter
    wandb_environ_mode: str = ""  # the environment's WANDB_MODE (logging.wandb_mode wins over it)
    forecast: Forecast | None = None
    layout: dict | None = None  # the layout `parallel.layout = "auto"` chose, for the config history (`zaya.plan.auto`)
    report_plots: Callable[[Path], dict[str, Path]] | None = None  # the report's plots, for W&B at the end
    lock: DirectoryLock | None = None  # rank 0's hold on the run directory, released when `run` ends
    phase_init: dict[int, WeightSource] = field(default_factory=dict)  # weights a later phase starts from, by index
