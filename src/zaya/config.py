"""Typed run configuration: dataclasses loaded from TOML, with dotted `--set` overrides.

    [model]      preset = "tiny", plus any model field to override (temp_init = 1.0, ...)
    [data]       path = "data/stdlib", seq_len, the batch ramp
    [train]      seed, max_steps, micro_batch_size, global_batch_size, precision, clipping, eval cadence
    [optim]      Muon + AdamW hyperparameters (zaya.optim.OptimConfig)
    [schedule]   the learning-rate schedule of the whole run
    [balance]    the balancing-bias controller
    [checkpoint] dir, every, keep, async_save
    [logging]    log_every, tensorboard, progress, Weights & Biases
    [parallel]   the device mesh (dp_replicate, dp_shard, cp), backend, timeouts (zaya.parallel.mesh)
    [[phases]]   optional: name, tokens, sources, seq_len, lr_scale, rope_theta, cp

Unknown keys and wrong types are errors that name the key and the file; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from zaya.data.order import DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_BLOCKS
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import PRESETS, get_preset
from zaya.optim import OptimConfig
from zaya.optim.schedule import ScheduleConfig
from zaya.parallel.fsdp import ACTIVATION_CHECKPOINTING
from zaya.parallel.mesh import ParallelConfig

# keys that moved: a config that still uses one is told where it went
MOVED_KEYS = {"train.collective_timeout_s": "parallel.timeout_s"}
PRECISIONS = ("bf16", "fp32", "auto")
WANDB_MODES = ("", "online", "offline", "disabled")


@dataclass
class ModelSection:
    preset: str = "tiny"  # the model's shape: a name in zaya.model.presets.PRESETS
    # Any ZayaConfig field, replacing the preset's value (e.g. temp_init, fp32_logits, rope_theta).
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, source: str) -> ZayaConfig:
        if self.preset not in PRESETS:
            raise ZayaError(f"{source}: model.preset '{self.preset}' does not exist (known: {', '.join(PRESETS)})")
        known = {f.name for f in dataclasses.fields(ZayaConfig)}
        for key in self.overrides:
            if key not in known:
                raise ZayaError(f"{source}: unknown key 'model.{key}'")
        try:
            return get_preset(self.preset, **self.overrides)
        except ZayaError as exc:
            raise ZayaError(f"{source}: {exc}") from None


@dataclass
class Source:
    """A dataset (a `zaya data build` output directory) and its weight in a mixture."""

    path: str  # a dataset directory (a `zaya data build` output)
    weight: float = 1.0  # its share of the phase's samples, relative to the other sources' weights


@dataclass
class DataSection:
    path: str = ""  # the default source; phases may name their own mixtures
    seq_len: int = 512  # tokens per training sequence (a phase may set its own)
    # Batch-size ramp in sequences (Megatron's rule); ramp_samples = 0 means the full batch from the start.
    ramp_start: int = 0  # the global batch size the ramp starts at
    ramp_increment: int = 0  # sequences added to the batch at each step of the ramp
    ramp_samples: int = 0  # consumed sequences over which the batch grows to train.global_batch_size
    # The sample order's two-level shuffle (zaya.data.order). Large blocks read few places on disk; a short run
    # on a small corpus wants block_size 1, or its first thousand steps see a few dozen places of it only.
    block_size: int = DEFAULT_BLOCK_SIZE  # consecutive sequences that stay together (1: each from anywhere)
    group_blocks: int = DEFAULT_GROUP_BLOCKS  # blocks whose sequences are shuffled together


@dataclass
class TrainSection:
    seed: int = 0  # seeds the model's initialisation and the data order
    max_steps: int = 100  # optimizer steps to train for (and schedule.total_steps unless that is set)
    micro_batch_size: int = 8  # sequences per rank per forward/backward; steps accumulate over them
    global_batch_size: int = 8  # sequences per optimizer step once any ramp is over
    # "bf16" (autocast, fp32 master weights), "fp32", or "auto": bf16 on accelerators and on CPUs whose bf16
    # matmuls are fast (measured at start), fp32 on the CPUs that emulate bf16 (~100x slower there), where
    # Newton-Schulz then runs in fp32 too (optim.ns_dtype)
    precision: str = "bf16"
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_every: int = 50  # steps between held-out evaluations; 0 disables
    eval_batches: int = 8  # global batches of held-out windows in each evaluation
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    # torch.compile each block (fuses the elementwise work; costs a compilation at start, needs a C++
    # compiler on CPUs and Triton on GPUs)
    compile: bool = False
    # recompute activations in backward instead of keeping them: "none", "full" (every block keeps only its
    # input) or "moe" (the MoE sublayers, whose expert activations are the largest)
    activation_checkpointing: str = "none"
    # a wall-clock limit on this process (a scheduler's, minus a margin): before it, the run writes a checkpoint
    # and exits with code 75 (EXIT_PREEMPTED) so that the resubmitted job resumes; 0: none
    max_time_s: float = 0.0
    # train for this much time in all (summed over resumes) instead of to max_steps, which stays a cap: the
    # wsd decay begins when the budget's last `schedule.decay_fraction` begins, spans the remaining time at
    # the measured step rate, and the run ends with it; 0: none
    time_budget_s: float = 0.0


@dataclass
class BalanceSection:
    """The balancing-bias controller (spec section 5.3): PID on the per-layer expert load error."""

    kp: float = 0.0  # proportional gain on the load error
    ki: float = 1e-3  # integral gain: the step of the accumulated error term
    kd: float = 0.0  # derivative gain on the change of the error
    # "linear": the integral term adds ki * error (the PID form); "sign": adds ki * sign(error), which with
    # kp = kd = 0 is DeepSeek-V3's loss-free balancing.
    error: str = "linear"
    enabled: bool = True  # false: the balancing biases are never updated


@dataclass
class CheckpointSection:
    dir: str = ""  # default: RUN_DIR/checkpoints
    every: int = 100  # steps between checkpoints; the last step is always saved
    keep: int = 3  # the newest checkpoints kept; older ones are deleted
    async_save: bool = False  # stage the tensors in memory and write them while training goes on


@dataclass
class LoggingSection:
    log_every: int = 1  # steps between logged metric rows
    tensorboard: bool = True  # write TensorBoard events to the run directory
    progress: bool = True  # a progress bar on rank 0
    # append each step's global sample positions to RUN_DIR/samples.jsonl: a record of what was trained on
    record_samples: bool = False
    # Weights & Biases (the optional `wandb` extra): config and metrics as they are logged, the report's plots at
    # the end; a resumed run continues the same W&B run
    wandb: bool = False
    wandb_project: str = "zaya"  # the W&B project
    wandb_name: str = ""  # default: the run directory's name
    wandb_mode: str = ""  # "online", "offline" or "disabled"; default: WANDB_MODE, else online


@dataclass
class Phase:
    """One stage of the curriculum; it ends once `tokens` tokens were trained in it (0: never)."""

    name: str = "main"  # unique; names the phase in logs and checkpoints
    tokens: int = 0  # tokens to train in this phase; 0: no limit (only the last phase)
    sources: list[Source] = field(default_factory=list)  # the mixture ([[phases.sources]]); empty: [data.path]
    seq_len: int = 0  # 0: data.seq_len
    lr_scale: float = 1.0  # multiplies the schedule inside this phase
    rope_theta: float = 0.0  # 0: keep the model's
    cp: int = 0  # context-parallel ranks per sequence in this phase; 0: parallel.cp


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    balance: BalanceSection = field(default_factory=BalanceSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    phases: list[Phase] = field(default_factory=list)
    source: str = "config"  # where it was read from, for messages

    def model_config(self) -> ZayaConfig:
        return self.model.build(self.source)

    def resolved_phases(self) -> list[Phase]:
        """The phases with defaults filled in (one unbounded phase on data.path if none are configured)."""
        phases = self.phases or [Phase()]
        resolved = []
        for phase in phases:
            sources = phase.sources or [Source(self.data.path)]
            resolved.append(dataclasses.replace(phase, sources=sources, seq_len=phase.seq_len or self.data.seq_len,
                                                cp=phase.cp or self.parallel.cp))
        return resolved

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data


# ---- loading ------------------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config and apply `key.path=value` overrides (values parsed as TOML, else strings)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ZayaError(f"{path}: not valid TOML ({exc})") from None
    for item in overrides:
        _apply_override(raw, item, path)
    schedule = raw.setdefault("schedule", {})
    if isinstance(schedule, dict) and "total_steps" not in schedule:
        # the schedule spans the run unless it says otherwise
        max_steps = raw.get("train", {}).get("max_steps", TrainSection.max_steps)
        if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
            schedule["total_steps"] = max_steps
    model = raw.get("model")
    if isinstance(model, dict):
        # every [model] key but `preset` overrides a model field
        raw["model"] = {"preset": model.get("preset", "tiny"),
                        "overrides": {k: v for k, v in model.items() if k != "preset"}}
    config = _build(RunConfig, raw, str(path), "")
    config.source = str(path)
    _validate(config)
    return config


def _apply_override(raw: dict, item: str, path: Path) -> None:
    if "=" not in item:
        raise ZayaError(f"--set {item!r}: expected key.path=value")
    key, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ZayaError(f"--set {key}: no entry {part} in '{'.'.join(parts[:i])}' of {path}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ZayaError(f"--set {key}: '{'.'.join(parts[: i + 1])}' is not a table")
    if isinstance(node, list):
        raise ZayaError(f"--set {key}: cannot replace a list entry")
    node[parts[-1]] = value


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ZayaError(f"{source}: '{where}' must be a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    for key in data:
        if f"{prefix}{key}" in MOVED_KEYS:
            raise ZayaError(f"{source}: key '{prefix}{key}' moved to '{MOVED_KEYS[prefix + key]}'")
        if key not in fields:
            raise ZayaError(f"{source}: unknown key '{prefix}{key}'")
    values = {key: _convert(hints[key], value, source, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**values)
    except ZayaError as exc:
        raise ZayaError(f"{source}: [{where}] {exc}") from None


def _convert(hint: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, source, key + ".")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ZayaError(f"{source}: key '{key}' must be a list")
        return [_convert(item, v, source, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is tuple:
        items = typing.get_args(hint)
        if not isinstance(value, list) or len(value) != len(items):
            raise ZayaError(f"{source}: key '{key}' must be a list of {len(items)} values")
        return tuple(_convert(t, v, source, f"{key}.{i}") for i, (t, v) in enumerate(zip(items, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ZayaError(f"{source}: key '{key}' must be a table")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(options[0], value, source, key)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in _TYPE_NAMES:
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ZayaError(f"{source}: key '{key}' must be {_TYPE_NAMES[hint]}, got {value!r}")
        return value
    raise ZayaError(f"{source}: key '{key}' has an unsupported value {value!r}")


def _positive(config: RunConfig, key: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ZayaError(f"{config.source}: key '{key}' must be {'>= 0' if allow_zero else 'positive'}, got {value}")


def _validate(config: RunConfig) -> None:
    config.model_config()  # the preset exists and the overrides make a valid model
    train = config.train
    for key in ("max_steps", "micro_batch_size", "global_batch_size", "eval_batches"):
        _positive(config, f"train.{key}", getattr(train, key))
    _positive(config, "train.eval_every", train.eval_every, allow_zero=True)
    _positive(config, "train.grad_clip", train.grad_clip, allow_zero=True)
    if train.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ZayaError(f"{config.source}: key 'train.activation_checkpointing' must be one of "
                        f"{', '.join(ACTIVATION_CHECKPOINTING)}, got {train.activation_checkpointing!r}")
    config.parallel.validate(config.source)
    if train.precision not in PRECISIONS:
        raise ZayaError(f"{config.source}: key 'train.precision' must be one of {', '.join(PRECISIONS)}, "
                        f"got {train.precision!r}")
    _positive(config, "train.max_time_s", train.max_time_s, allow_zero=True)
    _positive(config, "train.time_budget_s", train.time_budget_s, allow_zero=True)
    if train.time_budget_s and config.schedule.kind != "wsd":
        raise ZayaError(f"{config.source}: train.time_budget_s needs schedule.kind = 'wsd' (its decay is timed), "
                        f"got {config.schedule.kind!r}")
    if config.logging.wandb_mode not in WANDB_MODES:
        raise ZayaError(f"{config.source}: key 'logging.wandb_mode' must be one of "
                        f"{', '.join(repr(m) for m in WANDB_MODES)}, got {config.logging.wandb_mode!r}")
    if train.compile and train.precision == "fp32":
        raise ZayaError(f"{config.source}: train.compile needs train.precision = 'bf16' (compiled grouped matmuls "
                        "take bf16 operands)")
    if train.global_batch_size % train.micro_batch_size:
        raise ZayaError(f"{config.source}: train.global_batch_size ({train.global_batch_size}) is not a multiple of "
                        f"train.micro_batch_size ({train.micro_batch_size})")
    _positive(config, "data.seq_len", config.data.seq_len)
    _positive(config, "data.block_size", config.data.block_size)
    _positive(config, "data.group_blocks", config.data.group_blocks)
    _positive(config, "checkpoint.every", config.checkpoint.every)
    _positive(config, "checkpoint.keep", config.checkpoint.keep)
    _positive(config, "logging.log_every", config.logging.log_every)
    if config.balance.error not in ("linear", "sign"):
        raise ZayaError(f"{config.source}: key 'balance.error' must be 'linear' or 'sign'")
    if not config.data.path and any(not p.sources for p in config.phases or [Phase()]):
        raise ZayaError(f"{config.source}: key 'data.path' is required (or give every phase its sources)")
    names = [p.name for p in config.phases]
    if len(set(names)) != len(names):
        raise ZayaError(f"{config.source}: phase names must be unique, got {names}")
    for i, phase in enumerate(config.phases):
        _positive(config, f"phases.{i}.tokens", phase.tokens, allow_zero=True)
        _positive(config, f"phases.{i}.seq_len", phase.seq_len, allow_zero=True)
        _positive(config, f"phases.{i}.lr_scale", phase.lr_scale)
        _positive(config, f"phases.{i}.rope_theta", phase.rope_theta, allow_zero=True)
        _positive(config, f"phases.{i}.cp", phase.cp, allow_zero=True)
        for j, source in enumerate(phase.sources):
            _positive(config, f"phases.{i}.sources.{j}.weight", source.weight)
        if phase.tokens == 0 and i != len(config.phases) - 1:
            raise ZayaError(f"{config.source}: phase '{phase.name}' needs a token budget (only the last may be open)")
