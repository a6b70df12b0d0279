"""`zaya train` as a function: a run config, the process's environment and the launch resolved once into a run,
checked on every rank, and the trainer built from it.

    launch = Launch.from_env(os.environ)
    with launch.startup():                        # bad input on any rank stops every rank, reported once
        job = TrainingJob.check(load_config(path), run_dir, launch=launch, environ=os.environ)
    trainer = job.trainer()                       # the ranks agree on the precision; the trainer is built
    trainer.run()

What is resolved here, once, before anything is built: the device of this rank, the checkpoint to resume (or the
weights a fresh run starts from), the
precision of `train.precision = "auto"` (the resumed run's recorded one, else measured on every rank and fp32 if
any rank is slow in bf16), the run itself (`RunConfig.resolve`), what would stop it later if it were not checked
now (each phase's val split against its evaluations, the plan's memory against the device's: `planned`), and
from the environment the supervisor's
settings (heartbeats, incidents, policy, restart count, test-only faults), the job's clock, W&B's mode and the
cache of `zaya shapes`. The trainer and its parts read none of it from the environment themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from zaya.config import LAYOUT_KEYS, RunConfig
from zaya.device import auto_precision, compiles_training, fast_bf16_matmul, rank_device, resolve_device
from zaya.errors import ZayaError
from zaya.locking import DirectoryLock
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import backend_for
from zaya.plan.auto import Choice, Cluster, LayoutCache, apply_layout, choose, pin_line, recorded_values
from zaya.plan.devices import peak_flops
from zaya.plan.forecast import Forecast, target
from zaya.plan.table import cache_dir, default_table_path
from zaya.reading import os_reason
from zaya.resilience.faults import FaultInjector
from zaya.resilience.heartbeat import Heartbeat
from zaya.resilience.policy import Policy
from zaya.resilience.supervision import Supervision
from zaya.schema import shown
from zaya.train.hooks import Hooks
from zaya.train.inputs import (
    check_inputs,
    check_ranks_agree,
    checkpoint_dir,
    init_source,
    newest_checkpoint,
    phase_sources,
    read_saved,
    recorded_precision,
    saved_phase,
)
from zaya.train.log import RunLog
from zaya.train.preflight import check_eval_splits
from zaya.train.run import ResolvedRun
from zaya.train.setup import TrainerSetup
from zaya.train.stops import process_start, time_origin
from zaya.train.trainer import Trainer
from zaya.train.wandb_sink import check_wandb
from zaya.weights import WeightSource


@dataclass
class TrainingJob:
    """One rank's run, checked and resolved with this rank's own view (see the module docstring)."""

    config: RunConfig
    run_dir: Path
    launch: Launch
    environ: Mapping[str, str]
    device: torch.device
    supervision: Supervision
    policy: Policy
    resume_from: Path | None
    recorded: str | None  # the precision of the run resumed, if it says
    run: ResolvedRun
    allow_data_change: bool
    init_from: WeightSource | None = None  # the weights a fresh run starts from
    notes: tuple[str, ...] = ()  # what the checks found worth saying: the trainer says it at its start
    lock: DirectoryLock | None = None  # rank 0's hold on the run directory, handed to the trainer
    phase_init: dict[int, WeightSource] = dataclasses.field(default_factory=dict)  # later phases' own weights
    fingerprints: dict[str, list[str]] | None = None  # each phase's datasets', as the checks read them
    forecast: Forecast | None = None  # the plan of the run on its device, made (its memory checked) by the checks
    layout: Choice | None = None  # what `parallel.layout = "auto"` chose (`launch_layout`); None: the config's own
    given: RunConfig | None = None  # the config as given, before an `auto` layout was written into it

    @classmethod
    def check(cls, config: RunConfig, run_dir: Path | str, *, launch: Launch, environ: Mapping[str, str],
              allow_data_change: bool = False, allow_tokenizer_change: bool = False,
              measure_bf16: Callable[[torch.device], bool] = fast_bf16_matmul,
              allow_over_memory: bool = False) -> TrainingJob:
        """Resolve and check the run on this rank (inside the job's start-up check: a `ZayaError` here stops every
        rank). `measure_bf16` says whether bf16 matmuls are fast on the device (`zaya.device.fast_bf16_matmul`);
        `allow_over_memory` starts a run that the plan says does not fit its device's memory (`planned`)."""
        launch.init_timeout_s = config.parallel.init_timeout_s  # how long the start-up check waits for the others
        run_dir = check_run_dir(run_dir)
        device = config.train.device
        device = rank_device(resolve_device(None if device == "auto" else device), launch.local_rank)
        # one job per run directory: rank 0 holds it from before the checkpoints are looked at (a bad one is set
        # aside) until the run ends
        lock = DirectoryLock(Path(run_dir), "zaya train").acquire() if launch.rank == 0 else None
        try:
            return cls._check(config, run_dir, device, launch, environ, allow_data_change, allow_tokenizer_change,
                              measure_bf16, lock, allow_over_memory=allow_over_memory)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    def _check(cls, config, run_dir, device, launch, environ, allow_data_change, allow_tokenizer_change,
               measure_bf16, lock, allow_over_memory=False) -> TrainingJob:
        train = config.train
        supervision = Supervision.from_environ(environ)
        policy = Policy.load(supervision.policy_file)
        check_wandb(config.logging, config.source)  # a missing package stops every rank here, reported once
        backend_for(config.parallel, device, config.source)
        resume_from = newest_checkpoint(checkpoint_dir(config.checkpoint, run_dir), launch.rank,
                                        RunLog(Path(run_dir), launch.rank))
        recorded = recorded_precision(resume_from) if train.precision == "auto" else None
        precision = train.precision
        if precision == "auto":
            precision = recorded or auto_precision(device, measure_bf16)
        given = config
        layout = None
        if config.parallel.layout == "auto":
            layout = launch_layout(config, precision, device, launch, environ, resume_from)
            config = layout.config
        run = config.resolve(launch.world_size, precision, compiles_training(device))
        run.check_job()
        notes, fingerprints = check_inputs(run, resume_from, allow_data_change, allow_tokenizer_change)
        init_from, init_notes = init_source(run, resume_from, allow_tokenizer_change)
        later, later_notes = phase_sources(run, resume_from, allow_tokenizer_change)
        check_eval_splits(run, saved_phase(resume_from, len(run.phases)))  # not at its first evaluation
        forecast, memory_notes = planned(run, device, launch, environ, allow_over_memory)
        layout_notes = [layout.line] if layout is not None else []
        if layout is not None and forecast is not None:
            forecast.runner_up = layout.runner_up
        return cls(config, Path(run_dir), launch, environ, device, supervision, policy, resume_from, recorded, run,
                   allow_data_change, init_from, tuple(layout_notes + notes + init_notes + later_notes + memory_notes),
                   lock, later, fingerprints, forecast, layout, given)

    def trainer(self, **setup) -> Trainer:
        """The trainer, once every rank passed the start-up check: the ranks agree on a measured precision
        (fp32 if any rank is slow in bf16) and the run is final. `setup` replaces fields of the `TrainerSetup`
        made here (a test's clocks, say)."""
        try:
            return self._trainer(**setup)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def _trainer(self, **setup) -> Trainer:
        run, launch = self.run, self.launch
        if self.config.train.precision == "auto" and self.recorded is None:
            agreed = "fp32" if "fp32" in launch.gather("precision", run.precision) else "bf16"
            if agreed != run.precision:
                if self.layout is not None:  # chosen for the precision this rank measured
                    self.layout = launch_layout(self.given, agreed, self.device, launch, self.environ,
                                                self.resume_from)
                    self.config = self.layout.config
                run = self.run = self.config.resolve(launch.world_size, agreed, compiles_training(self.device))
                self.forecast = None  # planned for the precision this rank measured
        if self.layout is not None:
            run = self._agree_on_layout(run)
        check_ranks_agree(run, launch.gather, self.fingerprints)
        supervision = self.supervision
        listeners, scales = [], []
        if supervision.heartbeat_dir is not None:
            listeners.append(Heartbeat(supervision.heartbeat_dir, launch.rank))
        if supervision.faults:  # test-only
            faults = FaultInjector(supervision.faults, rank=launch.rank, attempt=launch.attempt,
                                   run=supervision.run_attempt, line=supervision.fault_line)
            listeners.append(faults)
            scales.append(faults.loss_factor)
        table = default_table_path(run.precision, cache_dir(self.environ))
        trainer_setup = TrainerSetup(
            self.run_dir, launch, self.device, resume_from=self.resume_from, allow_data_change=self.allow_data_change,
            init_from=self.init_from, notes=list(self.notes),
            peak_flops=peak_flops(self.device, torch.bfloat16 if run.precision == "bf16" else torch.float32,
                                  cache_dir(self.environ)),
            policy=self.policy, incidents_file=supervision.incidents_file, run_attempt=supervision.run_attempt,
            hooks=Hooks(listeners, scales), origin=time_origin(self.environ),
            started=None if "clock" in setup else process_start(),  # a caller's own clock: from the trainer's start
            wandb_environ_mode=self.environ.get("WANDB_MODE", ""),
            forecast=self.forecast or self._forecast(run, table),
            layout=None if self.layout is None else self.layout.record,
            report_plots=report_plots,
            lock=self.lock, phase_init=self.phase_init,
        )
        return Trainer(run, dataclasses.replace(trainer_setup, **setup))

    def _agree_on_layout(self, run: ResolvedRun) -> ResolvedRun:
        """Every rank trains in rank 0's choice: the ranks plan alike from alike figures, but a node whose
        measured table or free memory differs could choose otherwise."""
        mine = json.dumps(self.layout.values, sort_keys=True)
        chosen = self.launch.gather("layout", mine)[0]
        if chosen == mine:
            return run
        values = json.loads(chosen)
        pinned = " ".join(pin_line(values, self.given))
        self.layout = dataclasses.replace(self.layout, values=values, config=apply_layout(self.given, values),
                                          line=f"layout auto: rank 0's choice, {pinned}")
        self.config = self.layout.config
        self.forecast = None
        self.run = self.config.resolve(self.launch.world_size, run.precision, compiles_training(self.device))
        return self.run

    def _forecast(self, run: ResolvedRun, table: Path) -> Forecast:
        forecast = Forecast.for_run(run, self.device, self.launch.local_world_size, table, cache_dir(self.environ))
        if self.layout is not None:
            forecast.runner_up = self.layout.runner_up
        return forecast


def launch_layout(config: RunConfig, precision: str, device: torch.device, launch: Launch,
                  environ: Mapping[str, str], resume_from: Path | None, keep: bool = True) -> Choice:
    """The layout `parallel.layout = "auto"` trains `config` in on this job (`zaya.plan.auto`): the one its
    checkpoint recorded if it resumes on as many ranks, else the planner's fastest that fits. Where the device has
    no figures to plan with, or the planner fails, the config's own layout, said in one line; where nothing fits,
    one `ZayaError` naming the smallest shortfall. `keep`: rank 0 keeps a new search in the cache directory
    (`--print-config` writes nothing)."""
    world = launch.world_size
    saved = read_saved(resume_from) if resume_from is not None else None
    anew = ""
    if saved is not None and saved.world_size != world:
        anew = f" (re-planned: the checkpoint's run had {saved.world_size} rank(s))"
    elif saved is not None:
        anew = " (planned anew: the checkpoint's run did not choose its layout, or chose one the keys the config " \
               "gives now do not go with)"
        values = recorded_values(saved.config)
        if values is not None:
            kept = apply_layout(config, values)
            with contextlib.suppress(ZayaError):  # the config now gives a key that does not go with the rest
                kept.resolve(world, precision, compiles_training(device)).check_job()
                pinned = " ".join(f"--set {s}" for s in pin_line(values, config))
                return Choice(kept, values, f"layout auto: kept the layout the run chose for its {world} rank(s): "
                                            f"{pinned}")
    run = config.resolve(world, precision, compiles_training(device))
    cache = cache_dir(environ)
    own = f"training in the config's own layout ({_own(config)})"
    try:
        spec, table, note = target(run, device, default_table_path(precision, cache), launch.local_world_size, cache)
    except Exception as exc:  # a bad table or calibration: reported by `zaya plan`; the run starts as configured
        return Choice(config, {}, f"layout auto: no plan ({type(exc).__name__}: {exc}); {own}")
    if note and not note.startswith(" "):
        return Choice(config, {}, f"layout auto: {note}; {own}")
    cluster = Cluster(world, min(launch.local_world_size, world), spec, table)
    try:
        choice = choose(config, run, cluster, cache=LayoutCache(cache, writable=keep and launch.rank == 0))
    except ZayaError:
        raise  # nothing fits: said before anything is allocated
    except Exception as exc:  # a bug in the planner must not stop a run that would otherwise start
        return Choice(config, {}, f"layout auto: no plan ({type(exc).__name__}: {exc}); {own}")
    choice.line += anew
    return choice


def layout_to_print(config: RunConfig, launch: Launch, environ: Mapping[str, str]) -> tuple[RunConfig, str]:
    """For `zaya train --print-config` of a config whose layout is `auto`: the config with the layout a fresh
    launch of this job would choose, and a comment line that says so; nothing is written."""
    device = config.train.device
    device = rank_device(resolve_device(None if device == "auto" else device), launch.local_rank)
    precision = config.train.precision
    precision = auto_precision(device) if precision == "auto" else precision
    choice = launch_layout(config, precision, device, launch, environ, None, keep=False)
    return choice.config, (f"{choice.line} (as a fresh launch of {launch.world_size} rank(s) here; a resume on as "
                           "many keeps the layout its checkpoint recorded)")


def _own(config: RunConfig) -> str:
    return ", ".join(f"{key} = {getattr(getattr(config, key.split('.')[0]), key.split('.')[1])}"
                     for key in LAYOUT_KEYS)


def planned(run: ResolvedRun, device: torch.device, launch: Launch, environ: Mapping[str, str],
            allow_over_memory: bool = False) -> tuple[Forecast, list[str]]:
    """The plan of `run` on this rank's device (the forecast the trainer prints), and what it says of the memory:
    a run it says does not fit is refused here, before anything is allocated (`zaya.plan.fit`: the largest part,
    the smallest fix), unless `allow_over_memory`; then the log says so."""
    forecast = Forecast.for_run(run, device, launch.local_world_size,
                                default_table_path(run.precision, cache_dir(environ)), cache_dir(environ))
    problem = forecast.over_memory()
    if problem is None:
        return forecast, []
    if not allow_over_memory:
        raise ZayaError(f"{problem}; or pass --allow-over-memory to start anyway")
    return forecast, [f"warning: {problem}; starting anyway (--allow-over-memory)"]


def nothing_to_do(trainer: Trainer, run_dir: Path | str) -> str:
    """What `zaya train` says of a run that had no step left to take: where it ended and why. A run whose time
    budget is spent ended with its timed decay (the step it ended at is part of its checkpoint, a larger budget
    does not move it): it trains on only as a new run from its weights."""
    step, train, clock = trainer.progress.step, trainer.config.train, trainer.stops.clock
    if train.time_budget_s and clock.schedule_steps and clock.schedule_steps < train.max_steps:
        return (f"nothing to do: {run_dir} spent its time budget (train.time_budget_s = {train.time_budget_s:g} s, "
                f"{clock.run_seconds:,.0f} s spent) and ended with its learning-rate decay at step {step} (of "
                f"train.max_steps = {train.max_steps:,}); to train on from its weights, start a new run: "
                f"--set train.init_from={run_dir} --run-dir ANOTHER_DIR")
    return f"nothing to do: {run_dir} is already at step {step} of train.max_steps = {train.max_steps:,}"


def check_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` as a path, if it can be a run directory: named (an empty name, an unset shell variable's, would
    train into the working directory), a directory or nothing yet, reachable (no loop of links, no name too
    long); else one `ZayaError`. Nothing is written: this comes before the lock and the directory are made."""
    text = os.fspath(run_dir)
    if not text.strip():
        raise ZayaError(f"--run-dir {text!r}: empty; name the run's directory (an unset variable?)")
    if "\0" in text:
        raise ZayaError(f"--run-dir {shown(text)}: holds a NUL character, which no path can")
    path = Path(text)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.lexists(path):
            raise ZayaError(f"{path}: a symbolic link to nothing; the run directory must be a directory or not "
                            "exist yet") from None
        return path
    except OSError as exc:
        raise ZayaError(f"{path}: cannot be the run directory ({os_reason(exc)})") from None
    if stat.S_ISREG(mode):
        raise ZayaError(f"{path}: the run directory is a file")
    if not stat.S_ISDIR(mode):
        raise ZayaError(f"{path}: the run directory is not a directory (a FIFO, socket or device)")
    return path


def build_trainer(config: RunConfig, run_dir: Path | str, *, launch: Launch | None = None,
                  environ: Mapping[str, str] | None = None, allow_data_change: bool = False,
                  allow_tokenizer_change: bool = False, allow_over_memory: bool = False,
                  measure_bf16: Callable[[torch.device], bool] = fast_bf16_matmul, **setup) -> Trainer:
    """`TrainingJob.check` inside the start-up check, then `trainer(**setup)`: the trainer `zaya train` would run,
    for a config already loaded (by default in one process, in an empty environment)."""
    launch = launch or Launch()
    with launch.startup():
        job = TrainingJob.check(config, run_dir, launch=launch, environ=environ or {},
                                allow_data_change=allow_data_change, allow_tokenizer_change=allow_tokenizer_change,
                                measure_bf16=measure_bf16, allow_over_memory=allow_over_memory)
    return job.trainer(**setup)


def report_plots(run_dir: Path) -> dict[str, Path]:
    """The run report's plots, by name (`zaya.report`), for W&B at the end of a run."""
    try:
        import matplotlib  # noqa: F401  (the report's plots need it)
    except ImportError:
        raise ImportError("matplotlib is not installed: pip install 'zaya-stack[report]'") from None
    from zaya.report.report import build_report

    return {path.stem: path for path in build_report(run_dir).figures}

