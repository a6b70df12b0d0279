"""`zaya train`: the training loop, with phases, the batch ramp, checkpoints that lose nothing and exact resume.

One optimizer step:

    B     = ramp(consumed samples)                       global batch, in sequences
    batch = loader.next_batch(B)                         this rank's [B / dp, seq_len + 1] tokens
    for each micro-batch: loss = CE(model(x), y) * share;  loss.backward()   (FSDP2 reduce-scatters the
                                                          gradients; bf16 autocast, fp32 master shards;
                                                          with cp > 1 each rank takes its part of every
                                                          sequence: zaya.train.phases)
    clip the global norm;  lr = initial_lr * schedule(step) * phase scale;  optimizer.step()
                                                         (not taken if the norm is not finite)
    one all-reduce of the step's statistics;  balancing controller.update(global expert counts)
    the training signals: a loss spike rolls back to the last checkpoint (zaya.train.signals)
    phase switch once its token budget is spent (a new mesh if its cp differs);  metrics;  eval;  checkpoint
    (at startup the plan's prediction, after 20 steps the measured figures beside it: zaya.train.forecast)
    a stop request (SIGTERM, SIGUSR1, train.max_time_s) ends the run after the step with a checkpoint and exit
    code 75; a time budget times the decay (zaya.train.preemption)

The model is sharded from outside (`zaya.parallel.parallelize`) on one rank as on many: the same code path,
no gradient all-reduce of its own. Under `zaya supervise` each rank writes a heartbeat as it enters a
section (init, checkpoint_load, step, eval, checkpoint_save, done). A resumed run restores the model,
optimizer, controller, loader position, RNG states and phase from the newest valid checkpoint, written on any
number of ranks, and on the CPU continues bitwise-identically on the same mesh: nothing in the step depends
on anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zaya.config import RunConfig
from zaya.data.loader import TokenLoader
from zaya.data.ramp import BatchRamp, ramp_for
from zaya.data.shards import open_dataset
from zaya.device import (
    peak_flops,
    peak_memory_bytes,
    rank_device,
    resolve_device,
    resolve_precision,
    synchronize,
    tune_host_allocator,
    vendor,
)
from zaya.errors import StartupFailed, ZayaError
from zaya.model.flops import training_flops_per_token
from zaya.model.transformer import RouterStats, Zaya
from zaya.optim import build_optimizer, describe_param_groups, set_lr_multiplier
from zaya.parallel.comm import all_reduce
from zaya.parallel.dtensor import clip_grad_norm_
from zaya.parallel.fsdp import parallelize
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import ParallelContext, init_parallel
from zaya.resilience.faults import FaultInjector
from zaya.resilience.heartbeat import Heartbeat
from zaya.resilience.signals import as_ranges
from zaya.train import checkpoint as ckpt
from zaya.train import state as train_state
from zaya.train.balance import BalanceController, load_imbalance
from zaya.train.checkpoint_files import prewarm
from zaya.train.forecast import Forecast
from zaya.train.metrics import MetricsLogger
from zaya.train.phases import TrainingPhases
from zaya.train.preemption import StopRequest, TrainingStops, time_origin
from zaya.train.signals import TrainingSignals
from zaya.train.wandb_sink import check_wandb, open_wandb

CONFIG_FILE = "run_config.json"  # not config.json: that name marks a Hugging Face directory
LOG_FILE = "train.log"
RANK_LOG = "logs/rank-{}.log"  # the other ranks' messages, one file each
SAMPLES_FILE = "samples.jsonl"  # with logging.record_samples: the global positions each step trained on


@dataclass
class TrainState:
    """The non-tensor training state; saved as JSON in every checkpoint."""

    step: int = 0
    phase: int = 0
    phase_tokens: int = 0  # tokens trained in the current phase
    tokens: int = 0  # tokens trained in all
    samples: int = 0  # sequences trained in all: the batch ramp's clock
    loaders: dict[str, dict] = field(default_factory=dict)  # loader state per phase name
    fingerprints: dict[str, list[str]] = field(default_factory=dict)  # data fingerprints per phase name
    train_seconds: float = 0.0  # time spent in steps, summed over resumes (rank 0's clock)
    step_times: list[float] = field(default_factory=list)  # rank 0's recent step times, for the stop rules
    sample_times: list[float] = field(default_factory=list)  # the same per sequence, for a timed decay
    save_seconds: float = 0.0  # how long the last checkpoint took
    # with train.time_budget_s, once the decay is timed: the step it began at and the schedule's last step
    decay_start: int = 0
    schedule_steps: int = 0


class Trainer(TrainingSignals, TrainingPhases, TrainingStops):
    """Runs a `RunConfig` in `run_dir`, resuming from its newest valid checkpoint if there is one."""

    def __init__(self, config: RunConfig, run_dir: Path, *, allow_data_change: bool = False,
                 launch: Launch | None = None):
        self.run_dir = Path(run_dir)
        self.allow_data_change = allow_data_change
        self.launch = launch or Launch.from_env()
        # test-only; inert unless ZAYA_FAULTS is set
        self.faults = FaultInjector(rank=self.launch.rank, attempt=self.launch.restart)
        # the supervisor's channels; inert without it (no heartbeat file, the built-in policy)
        self.heartbeat = Heartbeat.from_env(self.launch.rank)
        self.heartbeat.beat("init", 0)
        self._init_signals()
        device = resolve_device(None if config.train.device == "auto" else config.train.device)
        self.device = rank_device(device, self.launch.local_rank)
        self.config = config
        self.model_config = config.model_config()
        self.phases = config.resolved_phases()
        self.started = time_origin()  # what train.max_time_s counts from
        self.stop = StopRequest()
        self.stopped: str | None = None  # why the run stopped before its end, if it did
        self.checkpoint_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else self.run_dir / "checkpoints"
        self._check_inputs()

    def _resolve_precision(self, config: RunConfig) -> RunConfig:
        """`train.precision = "auto"` made "bf16" or "fp32" for this device (`zaya.device.resolve_precision`):
        fp32 if any rank measures slow bf16 matmuls, so that every rank trains in the same precision. In fp32,
        Newton-Schulz runs in fp32 too (`optim.ns_dtype`): its bf16 products would be as slow as the model's."""
        if config.train.precision != "auto":
            return config
        slow = torch.tensor(float(resolve_precision("auto", self.device) != "bf16"), dtype=torch.float64,
                            device=self.device)
        self._all_reduce(slow)
        precision = "fp32" if slow.item() else "bf16"
        if config.train.compile and precision != "bf16":
            raise ZayaError(f"{config.source}: train.compile needs bf16, but train.precision = 'auto' is fp32 on "
                            f"{self.device} (its bf16 matmuls are slow); set train.compile = false")
        optim = config.optim if precision == "bf16" else dataclasses.replace(config.optim, ns_dtype="float32")
        return dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision), optim=optim)

    # ---- checks that run before anything is written ------------------------------------------------------

    def _check_inputs(self) -> None:
        train, where = self.config.train, self.config.source
        check_wandb(self.config)  # a missing package stops every rank here, reported once
        self.config.parallel.backend_for(self.device, where)
        ramp = self.ramp()
        self._check_phase_meshes(ramp)
        fingerprints = {}
        for phase in self.phases:
            datasets = [open_dataset(source.path) for source in phase.sources]  # clear errors if missing
            for dataset in datasets:
                dataset.check_vocab(self.model_config.vocab_size)
            fingerprints[phase.name] = [dataset.fingerprint for dataset in datasets]
        ramp.check_divisible(train.micro_batch_size, "train.micro_batch_size")
        # before the process group exists: rank 0 alone renames a bad checkpoint
        manager = ckpt.CheckpointManager(self.checkpoint_dir, keep=self.config.checkpoint.keep,
                                         rank=self.launch.rank)
        self.resume_from = manager.newest_valid(log=self._say) if self.checkpoint_dir.is_dir() else None
        self.start_phase = 0  # the phase the mesh is built for
        self.saved_step = -1  # the step of the last checkpoint this process wrote
        if self.resume_from is not None:
            version = ckpt.read_json(self.resume_from / ckpt.CONFIG_FILE).get("version")
            if version != ckpt.VERSION:
                raise ZayaError(f"{self.resume_from}: a checkpoint of format version {version}, whose optimizer "
                                f"state this version ({ckpt.VERSION}) cannot resume; its model still loads "
                                "(zaya convert, zaya.load_model)")
            saved = ckpt.read_json(self.resume_from / ckpt.TRAIN_STATE_FILE)["state"]
            self.start_phase = min(int(saved.get("phase", 0)), len(self.phases) - 1)
            for phase in self.phases:
                now = fingerprints[phase.name]
                before = saved.get("fingerprints", {}).get(phase.name)
                if before is not None and before != now and not self.allow_data_change:
                    raise ZayaError(
                        f"{self.resume_from}: phase '{phase.name}' was trained on data {before[0][:12]}..., but "
                        f"the config now gives {now[0][:12]}...; pass --allow-data-change to continue anyway"
                    )

    def ramp(self) -> BatchRamp:
        data = self.config.data
        return ramp_for(data.ramp_start, data.ramp_increment, self.config.train.global_batch_size,
                        data.ramp_samples)

    # ---- setup ------------------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        """A message: rank 0 shows it and appends it to train.log, every other rank to its own log file."""
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n"
        if not self.launch.is_main:
            path = self.run_dir / RANK_LOG.format(self.launch.rank)
            if self.run_dir.is_dir():
                path.parent.mkdir(exist_ok=True)
                with path.open("a", encoding="utf-8") as handle:
                    handle.write(stamped)
            return
        logger = getattr(self, "metrics", None)
        if logger is not None:
            logger.message(text)
        else:
            print(text, flush=True)
        if self.run_dir.is_dir():
            with (self.run_dir / LOG_FILE).open("a", encoding="utf-8") as handle:
                handle.write(stamped)

    def _build(self) -> None:
        train = self.config.train
        tune_host_allocator()
        previous = getattr(self, "parallel", None)
        self.parallel: ParallelContext = init_parallel(self._parallel_config(self.phases[self.start_phase]),
                                                       self.device, self.launch, self.config.source)
        self.config = self._resolve_precision(self.config)
        if previous is not None:  # a new mesh for a phase of another cp size, in the same process group
            self.parallel.owns_process_group = previous.owns_process_group
        if self.resume_from is not None:
            warm = threading.Thread(target=prewarm, args=(self.resume_from,), daemon=True)
            warm.start()  # the page cache fills while the model is being built
        torch.manual_seed(train.seed)
        with torch.device(self.device):
            model = Zaya(self.model_config)  # the same full model on every rank, then sharded
        routers = [block.moe.router for block in model.blocks]
        balance = self.config.balance
        self.controller = BalanceController(routers, balance.kp, balance.ki, balance.kd, balance.error)
        self.model = parallelize(model, self.parallel.fsdp_mesh, self.config, self.parallel.counter)
        self.optimizer = build_optimizer(self.model, self.config.optim, comm=self.parallel.counter)
        self.manager = ckpt.CheckpointManager(self.checkpoint_dir, keep=self.config.checkpoint.keep,
                                              rank=self.launch.rank, world_size=self.launch.world_size,
                                              control_group=self.parallel.control_group)
        self.state = TrainState()
        if self.resume_from is not None:
            self.heartbeat.beat("checkpoint_load", 0)
            self._restore(self.resume_from)
        self.loader = self._loader(self.state.phase)
        if self.phases[self.state.phase].rope_theta:
            self.model.set_rope_theta(self.phases[self.state.phase].rope_theta)
        self.flops_per_token = training_flops_per_token(self.model_config, self.phases[self.state.phase].seq_len)
        self.sequence = self._sequence(self.phases[self.state.phase])
        dtype = torch.bfloat16 if self.config.train.precision == "bf16" else torch.float32
        self.peak, self.peak_source = peak_flops(self.device, dtype)

    def _loader(self, index: int) -> TokenLoader:
        phase = self.phases[index]
        self.loader_phase = index
        data = self.config.data
        loader = TokenLoader([(s.path, s.weight) for s in phase.sources], phase.seq_len, self.config.train.seed,
                             rank=self.parallel.dp_rank, world_size=self.parallel.dp_size,
                             block_size=data.block_size, group_blocks=data.group_blocks)
        saved = self.state.loaders.get(phase.name)
        if saved is not None:
            try:
                loader.load_state_dict(saved)
            except ZayaError as error:
                if not self.allow_data_change:
                    raise ZayaError(f"{self.resume_from}: {error}; pass --allow-data-change to continue in this "
                                    "config's order") from None
                loader.load_state_dict({**loader.state_dict(), "consumed_samples": saved["consumed_samples"],
                                        "skip_ranges": saved.get("skip_ranges", [])})
        self.state.fingerprints[phase.name] = [d.fingerprint for d in loader.datasets]
        return loader

    # ---- checkpoints ------------------------------------------------------------------------------------

    def save(self) -> None:
        step = self.saved_step = self.state.step
        if self.loader_phase == self.state.phase:  # not at a remesh, between the phases' loaders
            self.state.loaders[self.phases[self.state.phase].name] = self.loader.state_dict()
        tensors, skeleton = train_state.capture(self.model, self.optimizer, self.controller.state)
        saved_state = {"state": dataclasses.asdict(self.state), "optimizer": skeleton,
                       "config": self.config.to_dict()}
        info = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": self.model_config.to_dict(),
                "dtype": "float32", "step": step, "mesh": self.parallel.describe()}
        tokenizer = self.loader.datasets[0].tokenizer_path
        self.faults("checkpoint", step)
        started = time.perf_counter()
        self.manager.save(step, tensors, saved_state, info, extra_files=[tokenizer],
                          async_save=self.config.checkpoint.async_save,
                          on_written=lambda: self.faults("checkpoint-written", step),
                          on_commit=lambda path: self.faults("committed", step, path))
        seconds = time.perf_counter() - started
        self.state.save_seconds = seconds  # the next save's estimate, for train.max_time_s
        self._say(f"checkpoint step {step} {'staged' if self.config.checkpoint.async_save else 'saved'} in "
                  f"{seconds:.2f} s")

    def _restore(self, directory: Path) -> None:
        info = ckpt.read_json(directory / ckpt.CONFIG_FILE)
        saved = ckpt.read_json(directory / ckpt.TRAIN_STATE_FILE)
        self.state = TrainState(**saved["state"])
        train_state.restore(directory, self.model, self.optimizer, self.controller.state, saved["optimizer"],
                            process_group=self.parallel.control_group)
        rng = directory / f"rng.rank{self.launch.rank}.json"
        if rng.is_file():
            ckpt.set_rng_state(ckpt.read_json(rng))
        self._say(f"resumed from {directory} (step {self.state.step}, phase '{self.phases[self.state.phase].name}'"
                  f", written by {info.get('world_size', 1)} rank(s))")

    # ---- the loop ---------------------------------------------------------------------------------------

    def _autocast(self):
        if self.config.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (global: the same on every rank)."""
        train = self.config.train
        phase = self.phases[self.state.phase]
        step = self.state.step
        host_started = time.perf_counter()
        self.faults("step", step)
        global_batch = self.ramp().at(self.state.samples)
        before = self.loader.consumed_samples
        batch = self.loader.next_batch(global_batch).to(self.device, non_blocking=True)
        keep = self.policy.training.spike_skip_steps
        self._windows = [*self._windows, (before, self.loader.consumed_samples)][-keep:] if keep else []
        host_time = time.perf_counter() - host_started  # before the first collective: nobody waits here
        factor = self.faults.loss_factor(step) if self.faults else 1.0
        stats = RouterStats(len(self.model.blocks), self.model_config.num_experts + 1, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        rows = batch.shape[0]
        for start in range(0, rows, train.micro_batch_size):
            micro = batch[start:start + train.micro_batch_size]
            with self._autocast():
                loss, grad_factor = self._micro_loss(micro, stats)
                if factor != 1.0:  # an injected NaN or spike
                    loss = loss * factor
            with stats.paused():  # checkpointed blocks route again in backward
                (loss * (grad_factor * micro.shape[0] / rows)).backward()
            loss_sum += loss.detach().double() * micro.shape[0]
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = clip_grad_norm_(params, train.grad_clip, self._all_reduce)
        lr_scale = self.schedule().multiplier(self.state.step) * phase.lr_scale
        set_lr_multiplier(self.optimizer, lr_scale)
        # the norm is global, so every rank takes the same branch
        skipped = not bool(torch.isfinite(grad_norm)) and self._skip_nonfinite(step, float(grad_norm))
        synchronize(self.device)
        started = time.perf_counter()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)  # parameters and optimizer state stay as they were
        else:
            self.optimizer.step()
            self._skipped_in_row = 0
        synchronize(self.device)
        optimizer_time = time.perf_counter() - started
        counts, entropy, loss_total, memory, sent, host_times, control = self._global_stats(stats, loss_sum,
                                                                                            host_time)
        if self.config.balance.enabled and not skipped:
            self.controller.update(counts)
        tokens = global_batch * phase.seq_len
        self.state.step += 1
        self.state.samples += global_batch
        self.state.tokens += tokens
        self.state.phase_tokens += tokens
        stop = self._take_controls(control)
        counts = counts.double()
        expert_share = counts[:, :-1] / counts.sum(1, keepdim=True).clamp_min(1)
        return {
            "loss": float(loss_total / global_batch),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "lr_multiplier": lr_scale,
            "batch_size": global_batch,
            "tokens": self.state.tokens,
            "phase": phase.name,
            "expert_load": expert_share.tolist(),
            "expert_imbalance": load_imbalance(counts).tolist(),
            "router_entropy": (entropy / counts.sum(1).clamp_min(1)).tolist(),
            "skip_rate": float(counts[:, -1].sum() / counts.sum().clamp_min(1)),
            "optimizer_time": optimizer_time,
            "peak_memory_bytes": memory,
            "comm_bytes": sent,
            "host_time": host_times,
            "skipped": skipped,
            "stop": stop,
        }

    def _all_reduce(self, tensor: torch.Tensor, group=None) -> None:
        all_reduce(tensor, group, self.parallel.counter, "trainer")

    def _global_stats(self, stats: RouterStats, loss_sum: torch.Tensor, host_time: float):
        """One all-reduce for everything the step reports: expert counts and router entropy (which the
        controller needs globally), the summed loss, and each rank's peak memory, bytes sent this step (the
        all-reduce's own included) and host time. Returns them summed over the ranks (per rank for the last
        three)."""
        world, rank = self.launch.world_size, self.launch.rank
        layers, routes = stats.counts.shape
        # the trailing three: stop requests by signal (any rank), rank 0's deadline and its previous step's time
        packed = torch.zeros(layers * routes + layers + 1 + 3 * world + 3, dtype=torch.float64, device=self.device)
        packed[:layers * routes] = stats.counts.flatten()  # exact: counts stay far below 2^53
        packed[layers * routes:layers * routes + layers] = stats.entropy_sum
        packed[layers * routes + layers] = loss_sum
        tail = layers * routes + layers + 1
        packed[tail + rank] = peak_memory_bytes(self.device)
        counter = self.parallel.counter
        counter.all_reduce("trainer", packed.numel() * packed.element_size(), world)
        packed[tail + world + rank] = sum(counter.take().values())
        packed[tail + 2 * world + rank] = host_time
        packed[-3] = float(self.stop.requested)
        if self.launch.is_main:
            packed[-2] = float(self._deadline())
            packed[-1] = self._last_seconds
        all_reduce(packed, None, None, "trainer")  # counted just above, before it was sent
        counts = packed[:layers * routes].round().long().view(layers, routes)
        memory = [int(v) for v in packed[tail:tail + world].tolist()]
        sent = [int(v) for v in packed[tail + world:tail + 2 * world].tolist()]
        host = packed[tail + 2 * world:tail + 3 * world].tolist()
        control = packed[-3:].tolist()
        return counts, packed[layers * routes:tail - 1], packed[tail - 1], memory, sent, host, control

    def _open_metrics(self) -> MetricsLogger:
        train, logging = self.config.train, self.config.logging
        sink, failure = None, None
        if self.launch.is_main:
            try:
                sink = open_wandb(self.run_dir, self.config, self.state.step)
            except ZayaError as exc:
                failure = exc
        if logging.wandb:  # a W&B run rank 0 could not open stops every rank, not rank 0 alone
            failed = torch.tensor(float(failure is not None), dtype=torch.float64, device=self.device)
            self._all_reduce(failed)
            if failed.item():
                raise failure or StartupFailed("rank 0 could not open its W&B run", rank=self.launch.rank)
        return MetricsLogger(self.run_dir, start_step=self.state.step, total_steps=train.max_steps,
                             tensorboard=logging.tensorboard, progress=logging.progress, enabled=self.launch.is_main,
                             sink=sink, progress_seconds=train.time_budget_s, seconds_done=self.state.train_seconds)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss over the first `eval_batches` global batches (of `global_batch_size` windows) of the
        current phase's val split: the same windows whatever the number of ranks."""
        train = self.config.train
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        for batch in self.loader.iter_eval_batches(train.global_batch_size, max_batches=train.eval_batches):
            batch = batch.to(self.device)
            for start in range(0, batch.shape[0], train.micro_batch_size):
                micro = batch[start:start + train.micro_batch_size]
                with self._autocast():
                    loss = self._micro_loss(micro, None)[0].double()
                total += loss * (micro.shape[0] / batch.shape[0])
            batches += 1
        self._all_reduce(total)
        total /= self.parallel.dp_size
        self.model.train()
        loss = float(total / max(1, batches))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def run(self) -> dict:
        """Train to `train.max_steps` (or the end of a timed decay); returns the last metrics row. A stop request
        (`zaya.train.preemption`) ends it early with a checkpoint and sets `stopped`."""
        try:
            with self.stop:
                return self._run()
        finally:
            parallel = getattr(self, "parallel", None)
            if parallel is not None:
                parallel.close()

    def _run(self) -> dict:
        self._build()
        train, logging = self.config.train, self.config.logging
        if self.launch.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2), encoding="utf-8")
        self.manager.clean_uncommitted()
        self.metrics = self._open_metrics()
        if self.state.step == 0:
            self._say("parameter groups:\n" + describe_param_groups(self.model, self.config.optim))
        self._say(f"training on {self.device} ({vendor(self.device)}), {train.precision}; "
                  f"{self.parallel.describe()}; peak {self.peak / 1e12:.2f} TFLOP/s per device ({self.peak_source})")
        forecast, message = Forecast.start(self.config, self.launch.world_size, self.device, self.state.phase)
        self._say(message)
        self.model.train()
        last: dict = {}
        peak = self.peak * self.launch.world_size
        self._last_seconds = 0.0  # rank 0's time of the step before, sent with the next step's statistics
        self._last_batch = 0  # that step's global batch (the same on every rank)
        try:
            while not self._stop_at_start() and self.state.step < self.end_step():
                self.heartbeat.beat("step", self.state.step)
                synchronize(self.device)
                started = time.perf_counter()
                row = self.train_step()
                stop = row.pop("stop")
                synchronize(self.device)
                seconds = self._last_seconds = time.perf_counter() - started
                self._last_batch = row["batch_size"]
                tokens_per_s = row["batch_size"] * self.phases[self.state.phase].seq_len / seconds
                row.update(step=self.state.step, time=time.time(), step_time=seconds, tokens_per_s=tokens_per_s,
                           mfu=tokens_per_s * self.flops_per_token / peak)
                if logging.record_samples and self.launch.is_main:
                    with (self.run_dir / SAMPLES_FILE).open("a", encoding="utf-8") as handle:
                        handle.write(json.dumps({"step": self.state.step,
                                                 "positions": as_ranges(self.loader.last_positions)}) + "\n")
                if self._watch(row):
                    continue  # rolled back: the loop goes on from the checkpoint's step
                self._maybe_switch_phase()
                step, end = self.state.step, self.end_step()
                if train.eval_every and (step % train.eval_every == 0 or step == end):
                    self.heartbeat.beat("eval", step)
                    row.update(self.evaluate())
                if step % logging.log_every == 0 or "eval_loss" in row or step == end or stop:
                    self.metrics.log(row)
                self.metrics.progress(step, {"loss": f"{row['loss']:.3f}", "tok/s": f"{tokens_per_s:,.0f}"},
                                      seconds=self.state.train_seconds)
                measured = forecast.observe(row) if forecast is not None else None
                if measured:
                    self._say(measured)
                if not row["skipped"] and not math.isfinite(row["loss"]):
                    raise ZayaError(f"step {step}: the loss is {row['loss']}; stopping (last checkpoint kept)")
                due = step % self.config.checkpoint.every == 0 or step == end or stop
                if due and self.saved_step != step:  # a move to a new mesh may just have saved this step
                    self.heartbeat.beat("checkpoint_save", step)
                    self.save()
                last = row
                if stop:
                    self._stopped(stop, step)
                    break
            self.manager.wait()
            self.heartbeat.beat("done", self.state.step)
            if not self.stopped:
                self.metrics.finish(self.run_dir)  # the report's plots to W&B, if it is on
        finally:
            self.metrics.close()
            self.loader.close()
        return last
