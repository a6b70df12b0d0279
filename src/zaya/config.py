"""Typed run configuration: the sections its packages own, composed, loaded from TOML with dotted `--set`
overrides, validated, and resolved for a job (`RunConfig.resolve`, `zaya.train.run`).

    [model]      preset = "tiny", plus any model field to override (temp_init = 1.0, ...)   zaya.model.presets
    [data]       path = "data/stdlib", seq_len, the batch ramp, the sample order's blocks     zaya.data.config
    [train]      seed, max_steps, batch sizes, precision, clipping, eval cadence, time limits zaya.train.config
    [optim]      Muon + AdamW hyperparameters                                                 zaya.optim.config
    [schedule]   the learning-rate schedule of the whole run                                  zaya.optim.schedule
    [balance]    the balancing-bias controller                                                zaya.train.config
    [checkpoint] dir, every, keep, async_save                                                 zaya.train.config
    [logging]    log_every, tensorboard, progress, Weights & Biases                           zaya.train.config
    [parallel]   the device mesh (dp_replicate, dp_shard, cp), backend, timeouts              zaya.parallel.config
    [[phases]]   optional: name, tokens, sources, seq_len, lr_scale, rope_theta, cp, ...  zaya.train.config

Unknown keys and wrong types are errors that name the key and the file; nothing is silently ignored. Importing
this module loads no torch: the sections import none of their packages' implementations.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from zaya.data.config import DataSection, Source
from zaya.data.ramp import ramp_for
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import ModelSection
from zaya.optim.config import OptimConfig
from zaya.optim.schedule import ScheduleConfig
from zaya.parallel.config import ACTIVATION_CHECKPOINTING, ParallelConfig
from zaya.train.config import (
    COMPILE_CHOICES,
    PRECISIONS,
    WANDB_MODES,
    BalanceSection,
    CheckpointSection,
    LoggingSection,
    Phase,
    TrainSection,
)
from zaya.train.run import ResolvedRun

# keys that moved: a config that still uses one is told where it went
MOVED_KEYS = {"train.collective_timeout_s": "parallel.timeout_s"}


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
            isolate = self.data.isolate_documents if phase.isolate_documents is None else phase.isolate_documents
            resolved.append(dataclasses.replace(phase, sources=sources, seq_len=phase.seq_len or self.data.seq_len,
                                                cp=phase.cp or self.parallel.cp, isolate_documents=isolate))
        return resolved

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data

    def resolve(self, world_size: int, precision: str | None = None, auto_compile: bool = True) -> ResolvedRun:
        """This config resolved for a job of `world_size` ranks (`zaya.train.run`; its `check_job` says whether
        the job fits). `precision` decides `train.precision = "auto"` ("bf16" or "fp32", as measured on the device
        or recorded by the run being resumed); in fp32 so chosen, Newton-Schulz runs in fp32 too: its bf16
        products would be as slow as the model's. `auto_compile` is what `train.compile = "auto"` becomes
        (`zaya.device.compiles_training`; the planner plans accelerators, where it is on)."""
        precision = precision or self.train.precision
        if precision not in ("bf16", "fp32"):
            raise ZayaError(f"{self.source}: train.precision = {self.train.precision!r} needs a decision "
                            "('bf16' or 'fp32') before the run is resolved")
        optim = self.optim
        if self.train.precision == "auto" and precision == "fp32":
            optim = dataclasses.replace(optim, ns_dtype="float32")
        compile_ = auto_compile if self.train.compile == "auto" else self.train.compile
        train = dataclasses.replace(self.train, precision=precision, compile=compile_)
        resolved = dataclasses.replace(self, train=train, optim=optim)
        ramp = ramp_for(self.data.ramp_start, self.data.ramp_increment, train.global_batch_size,
                        self.data.ramp_samples)
        return ResolvedRun(self.source, world_size, resolved.model_config(), tuple(resolved.resolved_phases()), ramp,
                           train, self.data, optim, self.schedule, self.balance, self.checkpoint,
                           self.logging, self.parallel, resolved.to_dict())


# ---- loading ------------------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config and apply `key.path=value` overrides (values parsed as TOML, else strings)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZayaError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ZayaError(f"{path}: a directory, not a TOML run config") from None
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({exc.strerror or exc})") from None
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
    _check_override_key(key.strip(), item)
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


def _check_override_key(key: str, item: str) -> None:
    """`--set` names one value of the run config: a key that exists (else the nearest one is suggested), and not a
    whole table."""
    parts = key.split(".")
    hint: Any = RunConfig
    for i, part in enumerate(parts):
        if typing.get_origin(hint) is list:  # an entry of [[phases]]: its index is checked against the file
            (hint,) = typing.get_args(hint)
            continue
        if hint is ModelSection:  # [model] takes the preset and any model field
            names = {"preset": str, **{f.name: typing.Any for f in dataclasses.fields(ZayaConfig)}}
        elif dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            names = {f.name: hints[f.name] for f in dataclasses.fields(hint) if f.name != "source"}
        else:
            return  # inside a free-form table
        where = ".".join(parts[: i + 1])
        if part not in names:
            if where in MOVED_KEYS:
                raise ZayaError(f"--set {item}: key '{where}' moved to '{MOVED_KEYS[where]}'")
            raise ZayaError(f"--set {item}: unknown key '{where}'{_nearest(part, names, '.'.join(parts[:i]))}")
        hint = names[part]
    if dataclasses.is_dataclass(hint):
        first = next(f.name for f in dataclasses.fields(hint))
        raise ZayaError(f"--set {item}: '{key}' is a table; set one of its keys, e.g. --set {key}.{first}=...")


def _nearest(name: str, names, prefix: str) -> str:
    """' (did you mean 'PREFIX.X'?)' for the known name nearest `name`, or the list of known names."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    dotted = f"{prefix}." if prefix else ""
    if close:
        return f" (did you mean '{dotted}{close[0]}'?)"
    return f" (known: {', '.join(sorted(names))})"


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
            raise ZayaError(f"{source}: unknown key '{prefix}{key}'{_nearest(key, fields, prefix.rstrip('.'))}")
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
        if value is None:
            return None
        for option in options[:-1]:  # the first that takes the value; the last one's error if none does
            try:
                return _convert(option, value, source, key)
            except ZayaError:
                continue
        return _convert(options[-1], value, source, key)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ZayaError(f"{source}: key '{key}' must be a finite number, got {value}")
    if hint in _TYPE_NAMES:
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ZayaError(f"{source}: key '{key}' must be {_TYPE_NAMES[hint]}, got {value!r}")
        return value
    raise ZayaError(f"{source}: key '{key}' has an unsupported value {value!r}")


# Upper bounds checked before anything is built: far above any real run, low enough that a typo (an extra
# digit, a value in the wrong unit) is refused in one line instead of filling the memory.
LIMITS = {"train.micro_batch_size": 2**16, "train.global_batch_size": 2**24, "train.eval_batches": 2**20,
          "data.seq_len": 2**24, "data.ramp_start": 2**24, "data.ramp_increment": 2**24, "phases.N.seq_len": 2**24,
          "phases.N.cp": 2**12}


def _positive(config: RunConfig, key: str, value: int | float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ZayaError(f"{config.source}: key '{key}' must be {'>= 0' if allow_zero else 'positive'}, got {value}")
    bound = LIMITS.get(".".join("N" if part.isdigit() else part for part in key.split(".")))
    if bound is not None and value > bound:
        raise ZayaError(f"{config.source}: key '{key}' = {value} is above the bound {bound:,}")


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
    _positive(config, "train.stop_grace_s", train.stop_grace_s, allow_zero=True)
    if train.time_budget_s and config.schedule.kind != "wsd":
        raise ZayaError(f"{config.source}: train.time_budget_s needs schedule.kind = 'wsd' (its decay is timed), "
                        f"got {config.schedule.kind!r}")
    if config.logging.wandb_mode not in WANDB_MODES:
        raise ZayaError(f"{config.source}: key 'logging.wandb_mode' must be one of "
                        f"{', '.join(repr(m) for m in WANDB_MODES)}, got {config.logging.wandb_mode!r}")
    if train.compile not in COMPILE_CHOICES:
        raise ZayaError(f"{config.source}: key 'train.compile' must be true, false or \"auto\", got {train.compile!r}")
    if train.global_batch_size % train.micro_batch_size:
        raise ZayaError(f"{config.source}: train.global_batch_size ({train.global_batch_size}) is not a multiple of "
                        f"train.micro_batch_size ({train.micro_batch_size})")
    if not 0 <= train.seed < 2**63:
        raise ZayaError(f"{config.source}: key 'train.seed' must be in [0, 2**63), got {train.seed}")
    for key in ("kp", "ki", "kd"):
        _positive(config, f"balance.{key}", getattr(config.balance, key), allow_zero=True)
    _positive(config, "data.seq_len", config.data.seq_len)
    for key in ("ramp_start", "ramp_increment", "ramp_samples"):
        _positive(config, f"data.{key}", getattr(config.data, key), allow_zero=True)
    _positive(config, "data.block_size", config.data.block_size)
    _positive(config, "data.group_blocks", config.data.group_blocks)
    _positive(config, "checkpoint.every", config.checkpoint.every)
    _positive(config, "checkpoint.keep", config.checkpoint.keep)
    _positive(config, "checkpoint.timeout_s", config.checkpoint.timeout_s, allow_zero=True)
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
    if config.train.init_from and config.phases and config.phases[0].init_from:
        raise ZayaError(f"{config.source}: train.init_from and phases.0.init_from both say where the run starts; "
                        "set one")
    for phase in config.resolved_phases():
        if phase.isolate_documents and phase.cp > 1:
            raise ZayaError(f"{config.source}: phase '{phase.name}' keeps documents apart (isolate_documents) "
                            f"with cp = {phase.cp}; context parallelism does not split packed documents yet")
