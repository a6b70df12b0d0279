"""`zaya train`: the training loop, with phases, the batch ramp, checkpoints that lose nothing and exact resume.

One optimizer step:

    B     = ramp(consumed samples)                       global batch, in sequences
    batch = loader.next_batch(B)                         this rank's [B / dp, seq_len + 1] tokens
    for each micro-batch: loss = CE(model(x), y) * share;  loss.backward()   (FSDP2 reduce-scatters the
                                                          gradients; bf16 autocast, fp32 master shards;
                                                          with cp > 1 each rank takes its part of every
                                                          sequence: zaya.train.phases)
    clip the global norm;  lr = initial_lr * schedule(step) * phase scale
    one all-reduce of the step's statistics, the norm's among them, read back: the step's only wait for the
                                                          device (zaya.train.stats)
    optimizer.step() (not taken if the norm is not finite);  balancing controller.update(global counts)
    the training signals: a loss spike rolls back to the last checkpoint (zaya.train.signals)
    phase switch once its token budget is spent (a new mesh if its cp differs);  metrics;  eval;  checkpoint
    a stop request (SIGTERM, SIGUSR1, Ctrl-C, train.max_time_s) ends the run after the step with a checkpoint
    and exit code 75; a time budget times the decay (zaya.train.stops)

The trainer is composed of objects that own their state: the curriculum (`Curriculum`), the stop rules
(`StopRules`), the training signals (`TrainingSignals`), the metrics (`MetricsLogger`) and the balancing
controller. What it is given comes resolved (`ResolvedRun`) with a `TrainerSetup`; what the outside installs
(heartbeats, fault injection, the plan's forecast) it only calls. The model is sharded from outside
(`zaya.parallel.fsdp.parallelize`) on one rank as on many: the same code path. A resumed run restores the
model, optimizer, controller, loader position, RNG states, clock and phase from the newest valid checkpoint,
written on any number of ranks, and on the CPU continues bitwise-identically on the same mesh.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import torch

from zaya import checkpoint as ckpt
from zaya.checkpoint.deadline import deadline
from zaya.device import (
    STARTUP_MEASURE_S,
    DeviceTimer,
    measure_matmul_flops,
    peak_memory_bytes,
    tune_host_allocator,
    use_tf32,
    vendor,
)
from zaya.errors import StartupFailed, ZayaError
from zaya.model.transformer import RouterStats, Zaya
from zaya.optim.hybrid import build_optimizer, describe_param_groups
from zaya.optim.schedule import set_lr_multiplier
from zaya.parallel.comm import all_reduce
from zaya.parallel.experts import ExpertViews, whole_shapes
from zaya.parallel.fsdp import accumulate, parallelize, reduce_and_clip, refresh, release
from zaya.parallel.materialize import materialize
from zaya.parallel.mesh import ParallelContext, init_parallel
from zaya.resilience.findings import Finding
from zaya.resilience.incidents import IncidentLog
from zaya.resilience.signals import as_ranges
from zaya.run_dir import INCIDENTS_FILE, SAMPLES_FILE, open_append
from zaya.train.balance import BalanceController, load_imbalance
from zaya.train.checkpointing import (
    Progress,
    capture,
    check_finite,
    model_tensors,
    optimizer_tensors,
    restore,
    train_state,
)
from zaya.train.history import record_init, record_start
from zaya.train.inputs import check_resumable, check_rng, checkpoint_dir, read_saved, saved_phase
from zaya.train.log import RunLog, step_line
from zaya.train.metrics import MetricsLogger
from zaya.train.phases import Curriculum
from zaya.train.run import ResolvedRun
from zaya.train.setup import TrainerSetup
from zaya.train.signals import TrainingSignals
from zaya.train.stats import StepStats
from zaya.train.stops import Clock, StopRules
from zaya.train.wandb_sink import open_wandb
from zaya.weights import WeightSource


class Trainer:
    """Runs a `ResolvedRun` in `setup.run_dir`, resuming from `setup.resume_from` if given."""

    def __init__(self, run: ResolvedRun, setup: TrainerSetup):
        self.config, self.setup = run, setup
        self.run_dir, self.launch, self.device = Path(setup.run_dir), setup.launch, setup.device
        self.hooks = setup.hooks
        self.log = RunLog(self.run_dir, self.launch.rank)
        self.hooks("init", 0)
        is_main = self.launch.is_main
        self.curriculum = Curriculum(run, allow_data_change=setup.allow_data_change)
        self.stops = StopRules(run.train, run.schedule, run.ramp, setup.origin, is_main=is_main, say=self.log,
                               clock=setup.clock, started=setup.started)
        incidents = IncidentLog(setup.incidents_file or self.run_dir / INCIDENTS_FILE)
        self.signals = TrainingSignals(setup.policy, incidents, attempt=setup.run_attempt, is_main=is_main,
                                       say=self.log)
        self.checkpoint_dir = checkpoint_dir(run.checkpoint, self.run_dir)
        self.resume_from = setup.resume_from
        self.start_phase = saved_phase(self.resume_from, len(run.phases))  # the phase the mesh is built for
        self.progress = Progress()
        self.saved_step = -1  # the step of the last checkpoint this process wrote
        self.parallel: ParallelContext | None = None
        self.metrics: MetricsLogger | None = None
        self.optimizer_timer: DeviceTimer | None = None  # the last step's optimizer, read when its row is logged
        self._init_seconds = 0.0  # how long loading `train.init_from` took
        self.untrained = True  # the weights are as initialised or loaded: no update applied to them yet
        self._resumed_record: dict | None = None  # the resolved config the resumed checkpoint recorded

    @property
    def stopped(self) -> str | None:
        """Why the run stopped before its end, if it did (`zaya.train.stops`)."""
        return self.stops.stopped

    # ---- building ---------------------------------------------------------------------------------------

    def _build(self) -> None:
        """The current phase's mesh, the model sharded on it, the optimizer, and the checkpoint restored."""
        tune_host_allocator()
        use_tf32(self.device, self.config.train.tf32)
        previous = self.parallel
        self.parallel = init_parallel(self.config.parallel_of(self.start_phase), self.device, self.launch,
                                      self.config.source)
        if previous is not None:  # a new mesh for a phase of another cp size, in the same process group
            self.parallel.owns_process_group = previous.owns_process_group
        if self.resume_from is not None:
            warm = threading.Thread(target=ckpt.prewarm, args=(self.resume_from,), daemon=True)
            warm.start()  # the page cache fills while the model is being built
        with torch.device("meta"):
            model = Zaya(self.config.model)  # no rank ever holds the whole model: its shards are made in place
        experts = self.parallel.experts
        model = parallelize(model, self.parallel.fsdp_mesh, self.config.parallelize, self.parallel.counter, experts,
                            context_parallel=self.parallel.cp_size > 1)
        self.model = materialize(model, self.device, self.config.train.seed, whole_shapes(model))
        self.views = None if experts is None else ExpertViews.of(self.model, experts)
        if self.resume_from is None and self.setup.init_from is not None:
            self._initialise_from(self.setup.init_from)
        self._fresh_optimizer()
        self.manager = ckpt.CheckpointManager(self.checkpoint_dir, keep=self.config.checkpoint.keep,
                                              rank=self.launch.rank, world_size=self.launch.world_size,
                                              control_group=self.parallel.control_group,
                                              timeout_s=self.config.checkpoint.timeout_s)
        self.progress, self.stops.clock = Progress(), Clock()
        if self.resume_from is not None:
            self.hooks("checkpoint_load", 0)
            with deadline(self.config.checkpoint.timeout_s, f"loading {self.resume_from}"):
                self._restore(self.resume_from)
        self.curriculum.enter(self.progress, self.model, self.parallel, self.resume_from)

    def _fresh_optimizer(self) -> None:
        """An optimizer without state, and the balancing controller starting from the biases the model has now."""
        balance = self.config.balance
        self.controller = BalanceController([block.moe.router for block in self.model.blocks], balance.kp,
                                            balance.ki, balance.kd, balance.error)
        self.optimizer = build_optimizer(self.model, self.config.optim, comm=self.parallel.counter)

    def _initialise_from(self, source: WeightSource) -> None:
        """A fresh run's weights from `train.init_from`, on every rank into its shards."""
        started = self.setup.timer()
        release(self.model)
        source.load_into(self.model, self.parallel.control_group, self.views)
        release(self.model)  # whole parameters a mode keeps gathered are the random ones until gathered again
        self._init_seconds = self.setup.timer() - started

    def _open_metrics(self) -> None:
        """The metrics logger, and its W&B sink if `logging.wandb`: one rank 0 cannot open stops every rank."""
        train, logging = self.config.train, self.config.logging
        sink, failure = None, None
        if self.launch.is_main:
            try:
                sink = open_wandb(self.run_dir, logging, self.config.record, self.progress.step,
                                  self.setup.wandb_environ_mode)
            except ZayaError as exc:
                failure = exc
        if logging.wandb:
            failed = torch.tensor(float(failure is not None), dtype=torch.float64, device=self.device)
            self._all_reduce(failed)
            if failed.item():
                raise failure or StartupFailed("rank 0 could not open its W&B run", rank=self.launch.rank)
        self.metrics = MetricsLogger(self.run_dir, start_step=self.progress.step, total_steps=train.max_steps,
                                     tensorboard=logging.tensorboard, progress=logging.progress,
                                     enabled=self.launch.is_main, sink=sink, progress_seconds=train.time_budget_s,
                                     seconds_done=self.stops.clock.run_seconds)
        self.log.screen = self.metrics

    # ---- checkpoints ------------------------------------------------------------------------------------

    def save(self) -> None:
        step = self.saved_step = self.progress.step
        self.hooks("checkpoint_save", step)
        self.curriculum.keep_loader_state(self.progress)
        release(self.model)  # the shards are what is saved, and what the optimizer's state is keyed by
        check_finite(step, model_tensors(self.model, self.controller.state), optimizer_tensors(self.optimizer),
                     self.device, self._all_reduce)
        tensors, skeleton = capture(self.model, self.optimizer, self.controller.state, self.views)
        state = train_state(self.progress, self.stops.clock, skeleton, self.config.record)
        info = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": self.config.model.to_dict(),
                "dtype": "float32", "precision": self.config.precision, "step": step, "mesh": self.parallel.describe()}
        async_save = self.config.checkpoint.async_save
        started = self.setup.timer()
        self.manager.save(step, tensors, state, info, extra_files=self.curriculum.tokenizer_files(),
                          async_save=async_save, on_written=lambda: self.hooks("checkpoint-written", step),
                          on_commit=lambda path: self.hooks("committed", step, path))
        seconds = self.setup.timer() - started
        self.stops.clock.save_seconds = seconds  # the next save's estimate, for train.max_time_s
        self.log(f"checkpoint step {step} {'staged' if async_save else 'saved'} in {seconds:.2f} s")

    def _restore(self, directory: Path) -> None:
        saved = read_saved(directory)
        self._resumed_record = saved.config
        self.progress, self.stops.clock = saved.progress, saved.clock
        restore(directory, self.model, self.optimizer, self.controller.state, saved.optimizer,
                process_group=self.parallel.control_group, views=self.views)
        release(self.model)  # whole parameters a mode keeps gathered are the old ones now
        self.untrained = False
        rng = directory / f"rng.rank{self.launch.rank}.json"
        if rng.is_file():
            state = ckpt.read_json(rng)
            check_rng(state, rng)
            ckpt.set_rng_state(state)
        self.log(f"resumed from {directory} (step {self.progress.step}, phase "
                 f"'{self.curriculum.phase(self.progress).name}', written by {saved.world_size} rank(s))")

    def _rollback(self, finding: Finding) -> bool:
        """Go back to the newest checkpoint before this step and never train on the recent steps' data."""
        self.manager.wait()
        step, phase = self.progress.step, self.curriculum.phase(self.progress).name
        target = self.manager.newest_valid(log=self.log, check=check_resumable)
        if target is None or read_saved(target).step >= step:
            self.signals.record(finding, "rollback", "no earlier checkpoint to roll back to; carrying on", step)
            return False
        start, stop = self.signals.window()
        self.hooks("checkpoint_load", step)
        self.metrics.close()
        self._restore(target)
        self.curriculum.enter(self.progress, self.model, self.parallel, target)
        if self.curriculum.phase(self.progress).name == phase and stop > start:
            self.curriculum.loader.add_skip_range(start, stop)
        self.signals.windows = []
        self._open_metrics()
        self.signals.record(finding, "rollback", f"rolled back to step {self.progress.step}; samples [{start}, "
                            f"{stop}) are skipped", self.progress.step)
        return True

    def _next_phase(self) -> None:
        """Move on to the next phase, on a new mesh if its cp differs (through a checkpoint at the boundary)."""
        step, before = self.progress.step, self.curriculum.phase(self.progress)
        remesh = self.curriculum.advance(self.progress)
        nxt = self.curriculum.phase(self.progress)
        self.log(f"step {step}: phase '{before.name}' done after {self.progress.tokens:,} tokens; starting "
                 f"'{nxt.name}' (seq_len {nxt.seq_len}{f', rope_theta {nxt.rope_theta:g}' if nxt.rope_theta else ''}"
                 f"{f', cp {nxt.cp}' if remesh else ''})")
        if not remesh:
            self.curriculum.enter(self.progress, self.model, self.parallel, self.resume_from)
        else:
            self.log(f"step {step}: phase '{nxt.name}' runs with cp = {nxt.cp}: checkpointing, to a new mesh")
            self.save()
            self.manager.wait()
            self.resume_from = self.manager.newest_valid(log=self.log, check=check_resumable)
            self.start_phase = self.progress.phase
            self._build()
            self.log(f"step {step}: now on {self.parallel.describe()}")
        source = self.setup.phase_init.get(self.progress.phase)
        if source is not None:  # the phase's own weights, and a fresh optimizer and controller for them
            self._initialise_from(source)
            self._fresh_optimizer()
            self.untrained = True
            if self.launch.is_main:
                self.log(f"step {step}: phase '{nxt.name}' "
                         + record_init(self.run_dir, source, self._init_seconds, phase=nxt.name))

    # ---- one step ---------------------------------------------------------------------------------------

    def _autocast(self):
        if self.config.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _all_reduce(self, tensor: torch.Tensor, group=None) -> None:
        all_reduce(tensor, group, self.parallel.counter, "trainer")

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (global: the same on every rank)."""
        train, progress, loader = self.config.train, self.progress, self.curriculum.loader
        phase, step = self.curriculum.phase(progress), progress.step
        host_started = time.perf_counter()
        self.hooks("step-work", step)
        global_batch = self.config.ramp.at(progress.samples)
        before = loader.consumed_samples
        host_batch = loader.next_batch(global_batch)  # kept: packed documents are planned from it
        batch = host_batch.to(self.device, non_blocking=True)
        self.signals.note_window(before, loader.consumed_samples)
        host_time = time.perf_counter() - host_started  # before the first collective: nobody waits here
        scale = self.hooks.loss_scale(step)
        routes = RouterStats(len(self.model.blocks), self.config.model.num_experts + 1, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        rows = batch.shape[0]
        for start in range(0, rows, train.micro_batch_size):
            micro = batch[start:start + train.micro_batch_size]
            accumulate(self.model, self.config.parallelize.sharding, last=start + micro.shape[0] == rows)
            with self._autocast():
                loss, grad_factor = self.curriculum.micro_loss(self.model, micro, routes,
                                                               host_batch[start:start + train.micro_batch_size])
                if scale != 1.0:
                    loss = loss * scale
            (loss * (grad_factor * micro.shape[0] / rows)).backward()
            loss_sum += loss.detach().double() * micro.shape[0]
        # the optimizer's: under ZeRO-1 the model's registered parameters are the whole gathered ones between
        # steps, and the reduced gradients are on the shards
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = reduce_and_clip(self.model, params, self.parallel, train.grad_clip, self._all_reduce)
        lr_scale = self.stops.schedule().multiplier(step) * phase.lr_scale
        set_lr_multiplier(self.optimizer, lr_scale)
        reduced = self._reduce(routes, loss_sum, grad_norm, host_time)  # the step's one read of the device
        # the norm is global, so every rank takes the same branch
        norm = float(reduced["grad_norm"])
        skipped = not math.isfinite(norm) and self.signals.nonfinite(step, norm, self.untrained)
        self.optimizer_timer = DeviceTimer(self.device)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)  # parameters and optimizer state stay as they were
        else:
            self.optimizer.step()
            refresh(self.model, self.config.parallelize.sharding)
            self.signals.updated()
            self.untrained = False
        self.optimizer_timer.stop()
        counts = torch.from_numpy(reduced["route_counts"]).round().long()
        if self.config.balance.enabled and not skipped:
            self.controller.update(counts)
        tokens = global_batch * phase.seq_len
        progress.step, progress.samples = step + 1, progress.samples + global_batch
        progress.tokens, progress.phase_tokens = progress.tokens + tokens, progress.phase_tokens + tokens
        stop = self.stops.take(reduced, progress.step, progress.samples)
        counts = counts.double()
        return {
            "loss": float(reduced["loss"]) / global_batch,
            "grad_norm": norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "lr_multiplier": lr_scale,
            "batch_size": global_batch,
            "tokens": progress.tokens,
            "phase": phase.name,
            "expert_load": (counts[:, :-1] / counts.sum(1, keepdim=True).clamp_min(1)).tolist(),
            "expert_imbalance": load_imbalance(counts).tolist(),
            "router_entropy": (torch.from_numpy(reduced["route_entropy"]) / counts.sum(1).clamp_min(1)).tolist(),
            "skip_rate": counts[:, -1].sum().tolist() / max(1.0, counts.sum().tolist()),
            "peak_memory_bytes": [int(v) for v in reduced["peak_memory_bytes"].tolist()],
            "comm_bytes": [int(v) for v in reduced["comm_bytes"].tolist()],
            "host_time": reduced["host_time"].tolist(),
            "skipped": skipped,
            "stop": stop,
        }

    def _reduce(self, routes: RouterStats, loss_sum: torch.Tensor, grad_norm: torch.Tensor,
                host_time: float) -> dict[str, np.ndarray]:
        """The step's one all-reduce and its one read back to the host, before the optimizer step (which it
        decides: a non-finite norm skips it): what the routers decided (the controller needs it globally), the
        summed loss, the global gradient norm, each rank's peak memory, host time and bytes sent since the
        last one (this all-reduce's own included, the previous step's optimizer's too), and what the stop rules
        carry."""
        stats = StepStats(self.launch.rank, self.launch.world_size, self.device)
        stats.sum("route_counts", routes.counts)
        stats.sum("route_entropy", routes.entropy_sum)
        stats.sum("loss", loss_sum)
        stats.same("grad_norm", grad_norm)
        stats.per_rank("peak_memory_bytes", peak_memory_bytes(self.device))
        stats.per_rank("host_time", host_time)
        stats.per_rank("comm_bytes", 0.0)
        self.stops.add_to(stats)
        counter = self.parallel.counter
        counter.all_reduce("trainer", stats.nbytes, self.launch.world_size)
        stats.set("comm_bytes", sum(counter.take().values()))
        return stats.reduce(lambda packed: all_reduce(packed, None, None, "trainer"))  # counted just above

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss over the first `eval_batches` global batches (of `global_batch_size` windows) of the
        current phase's val split: the same windows whatever the number of ranks."""
        train = self.config.train
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        for host_batch in self.curriculum.loader.iter_eval_batches(train.global_batch_size,
                                                                   max_batches=train.eval_batches):
            batch = host_batch.to(self.device)
            for start in range(0, batch.shape[0], train.micro_batch_size):
                micro = batch[start:start + train.micro_batch_size]
                with self._autocast():
                    loss = self.curriculum.micro_loss(self.model, micro, None,
                                                      host_batch[start:start + train.micro_batch_size])[0].double()
                total += loss * (micro.shape[0] / batch.shape[0])
            batches += 1
        release(self.model, self.config.parallelize.sharding)
        self._all_reduce(total)
        total /= self.parallel.dp_size
        self.model.train()
        loss = float(total / max(1, batches))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    # ---- the run ----------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train to the end; returns the last metrics row. A stop request (`zaya.train.stops`) sets `stopped`."""
        try:
            with self.stops.request, self.log.failures():  # an error that ends the run ends its log too
                self._build()
                if self.launch.is_main:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                    for line in record_start(self.run_dir, self.config.record, self._resumed_record,
                                             self.progress.step, self.setup.layout):
                        self.log(line)
                    for line in self.setup.notes:
                        self.log(line)
                    if self.resume_from is None and self.setup.init_from is not None:
                        self.log(record_init(self.run_dir, self.setup.init_from, self._init_seconds))
                self.manager.clean_uncommitted(log=self.log)
                self._open_metrics()
                try:
                    return self._loop()
                finally:
                    self.metrics.close()
                    self.curriculum.close()
        finally:
            if self.parallel is not None:
                self.parallel.close()
            if self.setup.lock is not None:
                self.setup.lock.release()

    def _loop(self) -> dict:
        train, logging = self.config.train, self.config.logging
        self._announce()
        self.model.train()
        last: dict = {}
        if self._stop_at_start():
            self.hooks("done", self.progress.step)
            return last
        self.stops.request.catch_interrupts()  # from here on, Ctrl-C stops after the step with a checkpoint
        while self.progress.step < self.stops.end_step():
            self.hooks("step", self.progress.step)  # before the step's clocks: a listener's I/O is not its time
            # no synchronize: the step reads the device once, and the work it leaves queued (its optimizer
            # step) is waited for by the next one's read, so the steps' times add up to the time they take
            started = self.setup.timer()
            row = self.train_step()
            stop = row.pop("stop")
            seconds = self.setup.timer() - started
            self.stops.stepped(seconds, row["batch_size"])
            self._measured(row, seconds)
            finding = self.signals.watch(self.progress.step, row)
            if finding is not None and self._rollback(finding):
                continue  # the loop goes on from the checkpoint's step
            if self.curriculum.done_with(self.progress):
                self._next_phase()
            step, end = self.progress.step, self.stops.end_step()
            if train.eval_every and (step % train.eval_every == 0 or step == end):
                self.hooks("eval", step)
                started = self.setup.timer()
                row.update(self.evaluate())
                self.stops.clock.eval_seconds = self.setup.timer() - started  # the end's, for a time budget
            if step % logging.log_every == 0 or "eval_loss" in row or step == end or stop:
                row["optimizer_time"] = self.optimizer_timer.seconds()  # read when logged: the wait is its own
                self.metrics.log(row)
                if self.launch.is_main:
                    self.log(step_line(row, end, self.stops.eta_seconds(step)), show=not self.metrics.shows_bar)
            self.metrics.progress(step, {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tokens_per_s']:,.0f}"},
                                  seconds=self.stops.clock.run_seconds)
            measured = self.setup.forecast.observe(row) if self.setup.forecast is not None else None
            for line in (measured or "").splitlines():  # the comparison, and a warning where the plan is off
                self.log(line)
            if not row["skipped"] and not math.isfinite(row["loss"]):
                raise ZayaError(f"step {step}: the loss is {row['loss']}; stopping (last checkpoint kept)")
            if step == end and not stop and self.signals.skipped_in_row:
                # its updates dropped, the run would end on weights whose loss is not finite, as if it had succeeded
                raise ZayaError(f"step {step}: the run ends on {self.signals.skipped_in_row} non-finite step(s) in a "
                                "row; stopping without a final checkpoint, the last committed one is kept")
            due = step % self.config.checkpoint.every == 0 or step == end or stop
            if due and self.saved_step != step:  # a move to a new mesh may just have saved this step
                self.save()
            last = row
            if stop:
                self._stop(stop, step)
                break
        self.manager.wait()
        self.hooks("done", self.progress.step)
        if not self.stopped:
            self.stops.finish(self.progress.step)
            if self.setup.report_plots is not None:
                self.metrics.finish(lambda: self.setup.report_plots(self.run_dir))  # the report's plots to W&B
        return last

    def _announce(self) -> None:
        """The start-up lines: the parameter groups (on a fresh run), where and how it trains, the forecast."""
        if self.progress.step == 0:
            self.log("parameter groups:\n" + describe_param_groups(self.model, self.config.optim))
        peak, source = self._peak_flops
        self.log(f"training on {self.device} ({vendor(self.device)}), {self.config.precision}, "
                 f"{self.config.parallelize.sharding} sharding; {self.parallel.describe()}; peak "
                 f"{peak / 1e12:.2f} TFLOP/s per device ({source})")
        if self.setup.forecast is not None:
            self.log(self.setup.forecast.start(self.progress.phase))

    @functools.cached_property
    def _peak_flops(self) -> tuple[float, str]:
        """One device's peak FLOP/s for the MFU, and where it came from: the setup's, else measured here once."""
        if self.setup.peak_flops is not None:
            return self.setup.peak_flops
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float32
        return measure_matmul_flops(self.device, dtype, seconds=STARTUP_MEASURE_S), "measured"

    def _measured(self, row: dict, seconds: float) -> None:
        """Add the step's time and rates to its metrics row, and record its samples where asked."""
        tokens_per_s = row["batch_size"] * self.curriculum.phase(self.progress).seq_len / seconds
        peak = self._peak_flops[0] * self.launch.world_size
        row.update(step=self.progress.step, time=time.time(), step_time=seconds, tokens_per_s=tokens_per_s,
                   mfu=tokens_per_s * self.curriculum.flops_per_token / peak)
        if self.config.logging.record_samples and self.launch.is_main:
            with open_append(self.run_dir / SAMPLES_FILE) as handle:
                handle.write(json.dumps({"step": self.progress.step,
                                         "positions": as_ranges(self.curriculum.loader.last_positions)}) + "\n")

    def _stop_at_start(self) -> bool:
        """A resumed run with no time left for a step and a checkpoint stops before its first (rank 0 decides)."""
        if not self.config.train.max_time_s:
            return False
        flag = torch.tensor(float(self.launch.is_main and self.stops.deadline()), dtype=torch.float64,
                            device=self.device)
        self._all_reduce(flag)
        if not flag.item():
            return False
        self._stop("max_time_s", self.progress.step)
        return True

    def _stop(self, reason: str, step: int) -> None:
        """The run stops early, its checkpoint committed: `zaya.train.stops.StopRules.stop`."""
        self.manager.wait()
        self.stops.stop(reason, step, committed=self.saved_step == step or self.resume_from is not None)

