"""`zaya train`: the training loop, with phases, the batch ramp, checkpoints that lose nothing and exact resume.

One optimizer step:

    B     = ramp(consumed samples)                       global batch, in sequences
    batch = loader.next_batch(B)                         this rank's [B / world, seq_len + 1] tokens
    for each micro-batch: loss = CE(model(x), y) * share;  loss.backward()   (bf16 autocast, fp32 masters)
    all-reduce gradients (data parallel); clip the global norm; lr = initial_lr * schedule(step) * phase scale
    optimizer.step();  balancing controller.update(global expert counts)
    phase switch once its token budget is spent;  metrics;  held-out eval;  checkpoint

A resumed run restores the model, optimizer, controller, loader position, RNG states and phase from the
newest valid checkpoint and continues bitwise-identically (on the CPU): nothing in the step depends on
anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zaya.config import RunConfig
from zaya.data.loader import TokenLoader
from zaya.data.ramp import BatchRamp
from zaya.data.shards import open_dataset
from zaya.device import peak_flops, resolve_device, synchronize, tune_host_allocator, vendor
from zaya.errors import ZayaError
from zaya.model.flops import training_flops_per_token
from zaya.model.transformer import RouterStats, Zaya
from zaya.optim import build_optimizer, describe_param_groups, set_lr_multiplier
from zaya.resilience.faults import FaultInjector
from zaya.train import checkpoint as ckpt
from zaya.train.balance import BalanceController, load_imbalance
from zaya.train.metrics import MetricsLogger

CONFIG_FILE = "run_config.json"  # not config.json: that name marks a Hugging Face directory
LOG_FILE = "train.log"


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


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    control_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device, timeout_s: float) -> Distributed:
    """Join the torchrun worker group if launched by torchrun (WORLD_SIZE > 1), else a single process.

    Every process group gets `timeout_s`, long enough that a network blip does not kill the job. The store
    keys are prefixed by torchrun's restart count: after a restart the store still holds the previous
    attempt's keys."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed()
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0 and not agent_store, timeout=timeout)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        backend = "gloo" if device.type == "cpu" else None
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"zaya/restart-{restart}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Distributed(rank=dist.get_rank(), world_size=dist.get_world_size(), control_group=control)


class Trainer:
    """Runs a `RunConfig` in `run_dir`, resuming from its newest valid checkpoint if there is one."""

    def __init__(self, config: RunConfig, run_dir: Path, *, allow_data_change: bool = False):
        self.config = config
        self.run_dir = Path(run_dir)
        self.allow_data_change = allow_data_change
        self.faults = FaultInjector()  # test-only; inert unless ZAYA_FAULTS is set
        self.model_config = config.model_config()
        self.phases = config.resolved_phases()
        self.device = resolve_device(None if config.train.device == "auto" else config.train.device)
        self.checkpoint_dir = Path(config.checkpoint.dir) if config.checkpoint.dir else self.run_dir / "checkpoints"
        self._check_inputs()

    # ---- checks that run before anything is written ------------------------------------------------------

    def _check_inputs(self) -> None:
        train = self.config.train
        fingerprints = {}
        for phase in self.phases:
            datasets = [open_dataset(source.path) for source in phase.sources]  # clear errors if missing
            for dataset in datasets:
                dataset.check_vocab(self.model_config.vocab_size)
            fingerprints[phase.name] = [dataset.fingerprint for dataset in datasets]
        ramp = self.ramp()
        ramp.check_divisible(train.micro_batch_size, "train.micro_batch_size")
        # before the process group exists: under torchrun the rank is in the environment
        rank = int(os.environ.get("RANK", "0"))
        manager = ckpt.CheckpointManager(self.checkpoint_dir, keep=self.config.checkpoint.keep, rank=rank)
        self.resume_from = manager.newest_valid(log=self._say) if self.checkpoint_dir.is_dir() else None
        if self.resume_from is not None:
            saved = ckpt.read_json(self.resume_from / ckpt.TRAIN_STATE_FILE)["state"]
            for phase in self.phases:
                now = fingerprints[phase.name]
                before = saved.get("fingerprints", {}).get(phase.name)
                if before is not None and before != now and not self.allow_data_change:
                    raise ZayaError(
                        f"{self.resume_from}: phase '{phase.name}' was trained on data {before[0][:12]}..., but "
                        f"the config now gives {now[0][:12]}...; pass --allow-data-change to continue anyway"
                    )

    def ramp(self) -> BatchRamp:
        data, final = self.config.data, self.config.train.global_batch_size
        if data.ramp_samples == 0 or data.ramp_start in (0, final):
            return BatchRamp(final, 0, final, 0)
        return BatchRamp(data.ramp_start, data.ramp_increment, final, data.ramp_samples)

    # ---- setup ------------------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        logger = getattr(self, "metrics", None)
        if logger is not None:
            logger.message(text)
        else:
            print(text, flush=True)
        if getattr(self, "dist", Distributed()).is_main and self.run_dir.is_dir():
            with (self.run_dir / LOG_FILE).open("a", encoding="utf-8") as handle:
                handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def _build(self) -> None:
        train = self.config.train
        tune_host_allocator()
        self.dist = init_distributed(self.device, train.collective_timeout_s)
        if self.resume_from is not None:
            warm = threading.Thread(target=ckpt.prewarm, args=(self.resume_from,), daemon=True)
            warm.start()  # the page cache fills while the model is being built
        torch.manual_seed(train.seed)
        with torch.device(self.device):
            self.model = Zaya(self.model_config)
        self.optimizer = build_optimizer(self.model, self.config.optim)
        routers = [block.moe.router for block in self.model.blocks]
        balance = self.config.balance
        self.controller = BalanceController(routers, balance.kp, balance.ki, balance.kd, balance.error)
        self.manager = ckpt.CheckpointManager(self.checkpoint_dir, keep=self.config.checkpoint.keep,
                                              rank=self.dist.rank, world_size=self.dist.world_size,
                                              control_group=self.dist.control_group)
        self.state = TrainState()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if train.compile:
            for block in self.model.blocks:
                block.compile()
        self.loader = self._loader(self.state.phase)
        if self.phases[self.state.phase].rope_theta:
            self.model.set_rope_theta(self.phases[self.state.phase].rope_theta)
        self.flops_per_token = training_flops_per_token(self.model_config, self.phases[self.state.phase].seq_len)
        dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32
        self.peak, self.peak_source = peak_flops(self.device, dtype)

    def _loader(self, index: int) -> TokenLoader:
        phase = self.phases[index]
        loader = TokenLoader([(s.path, s.weight) for s in phase.sources], phase.seq_len, self.config.train.seed,
                             rank=self.dist.rank, world_size=self.dist.world_size)
        saved = self.state.loaders.get(phase.name)
        if saved is not None:
            try:
                loader.load_state_dict(saved)
            except ZayaError:
                if not self.allow_data_change:
                    raise
                loader.load_state_dict({**loader.state_dict(), "consumed_samples": saved["consumed_samples"],
                                        "skip_ranges": saved.get("skip_ranges", [])})
        self.state.fingerprints[phase.name] = [d.fingerprint for d in loader.datasets]
        return loader

    # ---- checkpoints ------------------------------------------------------------------------------------

    def _tensors(self) -> dict:
        skeleton, optim_tensors = ckpt.split_tensors(self.optimizer.state_dict())
        self._optim_skeleton = skeleton
        return {"model": self.model.state_dict(), "optim": optim_tensors,
                "controller": self.controller.state.state_dict()}

    def save(self) -> None:
        step = self.state.step
        self.state.loaders[self.phases[self.state.phase].name] = self.loader.state_dict()
        tensors = self._tensors()
        train_state = {"state": dataclasses.asdict(self.state), "optimizer": self._optim_skeleton,
                       "config": self.config.to_dict()}
        info = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": self.model_config.to_dict(),
                "dtype": "float32", "step": step}
        tokenizer = self.loader.datasets[0].tokenizer_path
        self.faults("checkpoint", step)
        started = time.perf_counter()
        self.manager.save(step, tensors, train_state, info, extra_files=[tokenizer],
                          async_save=self.config.checkpoint.async_save,
                          on_written=lambda: self.faults("checkpoint-written", step),
                          on_commit=lambda path: self.faults("committed", step))
        self._say(f"checkpoint step {step} {'staged' if self.config.checkpoint.async_save else 'saved'} in "
                  f"{time.perf_counter() - started:.2f} s")

    def _restore(self, directory: Path) -> None:
        saved = ckpt.read_json(directory / ckpt.TRAIN_STATE_FILE)
        self.state = TrainState(**saved["state"])
        skeleton = saved["optimizer"]
        metadata = ckpt.read_metadata(directory)
        optim_tensors = {}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith("optim."):
                optim_tensors[key.removeprefix("optim.")] = torch.empty(
                    tuple(meta.size), dtype=meta.properties.dtype, device="cpu")
        tensors = {"model": self.model.state_dict(), "optim": optim_tensors,
                   "controller": self.controller.state.state_dict()}
        ckpt.load_tensors(directory, tensors)
        self.model.load_state_dict(tensors["model"])
        self.optimizer.load_state_dict(ckpt.join_tensors(skeleton, tensors["optim"]))
        self.controller.state.load_state_dict(tensors["controller"])
        rng = directory / f"rng.rank{self.dist.rank}.json"
        if rng.is_file():
            ckpt.set_rng_state(ckpt.read_json(rng))
        self._say(f"resumed from {directory} (step {self.state.step}, phase '{self.phases[self.state.phase].name}')")

    # ---- the loop ---------------------------------------------------------------------------------------

    def _autocast(self):
        if self.config.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics."""
        train = self.config.train
        phase = self.phases[self.state.phase]
        global_batch = self.ramp().at(self.state.samples)
        batch = self.loader.next_batch(global_batch).to(self.device, non_blocking=True)
        stats = RouterStats(len(self.model.blocks), self.model_config.num_experts + 1, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        rows = batch.shape[0]
        for start in range(0, rows, train.micro_batch_size):
            micro = batch[start:start + train.micro_batch_size]
            with self._autocast():
                loss = self.model.loss(micro[:, :-1], micro[:, 1:], router_stats=stats)
            (loss * (micro.shape[0] / rows)).backward()
            loss_sum += loss.detach().double() * micro.shape[0]
        if self.dist.world_size > 1:
            _all_reduce_gradients(self.model)
            dist.all_reduce(stats.counts)
            dist.all_reduce(stats.entropy_sum)
            dist.all_reduce(loss_sum)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if train.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        lr_scale = self.config.schedule.multiplier(self.state.step) * phase.lr_scale
        set_lr_multiplier(self.optimizer, lr_scale)
        self.optimizer.step()
        if self.config.balance.enabled:
            self.controller.update(stats.counts)
        tokens = global_batch * phase.seq_len
        self.state.step += 1
        self.state.samples += global_batch
        self.state.tokens += tokens
        self.state.phase_tokens += tokens
        counts = stats.counts.double()
        expert_share = counts[:, :-1] / counts.sum(1, keepdim=True).clamp_min(1)
        return {
            "loss": float(loss_sum / global_batch),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "lr_multiplier": lr_scale,
            "batch_size": global_batch,
            "tokens": self.state.tokens,
            "phase": phase.name,
            "expert_load": expert_share.tolist(),
            "expert_imbalance": load_imbalance(counts).tolist(),
            "router_entropy": (stats.entropy_sum / counts.sum(1).clamp_min(1)).tolist(),
            "skip_rate": float(counts[:, -1].sum() / counts.sum().clamp_min(1)),
        }

    def _maybe_switch_phase(self) -> None:
        phase = self.phases[self.state.phase]
        if phase.tokens and self.state.phase_tokens >= phase.tokens and self.state.phase + 1 < len(self.phases):
            self.state.loaders[phase.name] = self.loader.state_dict()
            self.loader.close()
            self.state.phase += 1
            self.state.phase_tokens = 0
            nxt = self.phases[self.state.phase]
            self.loader = self._loader(self.state.phase)
            if nxt.rope_theta:
                self.model.set_rope_theta(nxt.rope_theta)
            self.flops_per_token = training_flops_per_token(self.model_config, nxt.seq_len)
            self._say(f"step {self.state.step}: phase '{phase.name}' done after {self.state.tokens:,} tokens; "
                      f"starting '{nxt.name}' (seq_len {nxt.seq_len}"
                      f"{f', rope_theta {nxt.rope_theta:g}' if nxt.rope_theta else ''})")

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
                    loss = self.model.loss(micro[:, :-1], micro[:, 1:]).double()
                total += loss * (micro.shape[0] / batch.shape[0])
            batches += 1
        if self.dist.world_size > 1:
            dist.all_reduce(total)
            total /= self.dist.world_size
        self.model.train()
        loss = float(total / max(1, batches))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def run(self) -> dict:
        """Train to `train.max_steps`; returns the last metrics row."""
        self._build()
        train, logging = self.config.train, self.config.logging
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2), encoding="utf-8")
        self.manager.clean_uncommitted()
        self.metrics = MetricsLogger(self.run_dir, start_step=self.state.step, total_steps=train.max_steps,
                                     tensorboard=logging.tensorboard, progress=logging.progress,
                                     enabled=self.dist.is_main)
        if self.state.step == 0:
            self._say("parameter groups:\n" + describe_param_groups(self.model, self.config.optim))
        self._say(f"training on {self.device} ({vendor(self.device)}, {self.dist.world_size} process(es)), "
                  f"{train.precision}; "
                  f"peak {self.peak / 1e12:.2f} TFLOP/s ({self.peak_source})")
        self.model.train()
        last: dict = {}
        try:
            while self.state.step < train.max_steps:
                self.faults("step", self.state.step)
                synchronize(self.device)
                started = time.perf_counter()
                row = self.train_step()
                synchronize(self.device)
                seconds = time.perf_counter() - started
                tokens_per_s = row["batch_size"] * self.phases[self.state.phase].seq_len / seconds
                row.update(step=self.state.step, time=time.time(), step_time=seconds, tokens_per_s=tokens_per_s,
                           mfu=tokens_per_s * self.flops_per_token / self.peak)
                self._maybe_switch_phase()
                step = self.state.step
                if train.eval_every and (step % train.eval_every == 0 or step == train.max_steps):
                    row.update(self.evaluate())
                if step % logging.log_every == 0 or "eval_loss" in row or step == train.max_steps:
                    self.metrics.log(row)
                self.metrics.progress(step, {"loss": f"{row['loss']:.3f}", "tok/s": f"{tokens_per_s:,.0f}"})
                if not math.isfinite(row["loss"]):
                    raise ZayaError(f"step {step}: the loss is {row['loss']}; stopping (last checkpoint kept)")
                if step % self.config.checkpoint.every == 0 or step == train.max_steps:
                    self.save()
                last = row
            self.manager.wait()
        finally:
            self.metrics.close()
            self.loader.close()
        return last


def _all_reduce_gradients(model: Zaya) -> None:
    """Average gradients across ranks in one flat buffer per dtype (plain data parallelism)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    world = dist.get_world_size()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for grad in group:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

