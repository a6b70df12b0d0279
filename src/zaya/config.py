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
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zaya.config_sets import Origin, apply_override, nearest, shown_key
from zaya.data.config import DataSection, Source
from zaya.data.ramp import ramp_for
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.model.presets import ModelSection
from zaya.optim.config import OptimConfig
from zaya.optim.schedule import ScheduleConfig
from zaya.parallel.config import ACTIVATION_CHECKPOINTING, ParallelConfig, sequence_split_problem
from zaya.ranges import Range
from zaya.reading import read_toml
from zaya.schema import shown, type_name
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
# what `parallel.layout = "auto"` chooses (and `phases.N.cp`), unless the config gives it (`RunConfig.given`)
LAYOUT_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.ep", "parallel.sharding",
               "train.micro_batch_size", "train.activation_checkpointing")


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
    # the keys of LAYOUT_KEYS and `phases.N.cp` that the file or --set gave (a config made in code gives none):
    # what `parallel.layout = "auto"` keeps
    given: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)

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
        data.pop("given")
        return data

    def resolve(self, world_size: int, precision: str | None = None, auto_compile: bool = True) -> ResolvedRun:
        """This config resolved for a job of `world_size` ranks (`zaya.train.run`; its `check_job` says whether
        the job fits). `precision` decides `train.precision = "auto"` ("bf16" or "fp32", as measured on the device
        or recorded by the run being resumed); in fp32 so chosen, Newton-Schulz runs in fp32 too: its bf16
        products would be as slow as the model's. `auto_compile` is what `train.compile = "auto"` becomes
        (`zaya.device.compiles_training`; the planner plans accelerators, where it is on)."""
        check_positions(self, self.model_config(), Origin(self.source))  # a config made in code, not loaded
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
    raw = read_toml(path, "config", "a TOML run config")
    sets = {}
    for item in overrides:
        key = apply_override(raw, item, path, RunConfig, MOVED_KEYS)
        sets[key] = item if len(item) <= 80 and item.isprintable() else key  # a long value is not echoed
    schedule = raw.setdefault("schedule", {})
    train = raw.get("train")
    if isinstance(schedule, dict) and "total_steps" not in schedule:
        # the schedule spans the run unless it says otherwise (a max_steps out of range is refused below)
        max_steps = train.get("max_steps", TrainSection.max_steps) if isinstance(train, dict) else None
        if isinstance(max_steps, int) and not isinstance(max_steps, bool) and RANGES["train.max_steps"].holds(
                max_steps):
            schedule["total_steps"] = max_steps
            if "train.max_steps" in sets:
                sets["schedule.total_steps"] = sets["train.max_steps"]
    model = raw.get("model")
    if isinstance(model, dict):
        # every [model] key but `preset` overrides a model field
        raw["model"] = {"preset": model.get("preset", "tiny"),
                        "overrides": {k: v for k, v in model.items() if k != "preset"}}
    origin = Origin(str(path), sets)
    config = _build(RunConfig, raw, origin, "")
    config.source = str(path)
    config.given = given_layout_keys(raw)
    _validate(config, origin)
    return config


def given_layout_keys(raw: dict) -> frozenset[str]:
    """The layout keys (`LAYOUT_KEYS`, `phases.N.cp`) a config's table, overrides applied, gives; `dp_shard = -1`
    (every rank the others leave) constrains nothing and is not one."""
    given = set()
    for key in LAYOUT_KEYS:
        section, name = key.split(".")
        table = raw.get(section)
        if isinstance(table, dict) and name in table and not (key == "parallel.dp_shard" and table[name] == -1):
            given.add(key)
    phases = raw.get("phases")
    for index, phase in enumerate(phases if isinstance(phases, list) else []):
        if isinstance(phase, dict) and phase.get("cp") not in (None, 0):
            given.add(f"phases.{index}.cp")
    return frozenset(given)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _build(cls: type, data: Any, origin: Origin, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ZayaError(f"{origin.of(where)}: '{where}' must be a table, got {type_name(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("source", "given")}
    for key in data:
        if f"{prefix}{key}" in MOVED_KEYS:
            raise ZayaError(f"{origin}: key '{prefix}{key}' moved to '{MOVED_KEYS[prefix + key]}'")
        if key not in fields:
            raise ZayaError(f"{origin}: unknown key '{shown_key(prefix + key)}'"
                            f"{nearest(key, fields, prefix.rstrip('.'))}")
    values = {key: _convert(hints[key], value, origin, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**values)
    except ZayaError as exc:
        raise ZayaError(f"{_about(str(exc), origin, where)}: [{where}] {exc}") from None


def _convert(hint: Any, value: Any, origin: Origin, key: str) -> Any:
    kind = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, origin, key + ".")
    if kind is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            what = "an array of tables" if dataclasses.is_dataclass(item) else "a list"
            raise ZayaError(f"{origin.of(key)}: key '{key}' must be {what}, got {type_name(value)}")
        return [_convert(item, v, origin, f"{key}.{i}") for i, v in enumerate(value)]
    if kind is tuple:
        items = typing.get_args(hint)
        if not isinstance(value, list) or len(value) != len(items):
            raise ZayaError(f"{origin.of(key)}: key '{key}' must be a list of {len(items)} values, got "
                            f"{f'{len(value)} values' if isinstance(value, list) else type_name(value)}")
        return tuple(_convert(t, v, origin, f"{key}.{i}") for i, (t, v) in enumerate(zip(items, value, strict=True)))
    if kind is dict:
        if not isinstance(value, dict):
            raise ZayaError(f"{origin.of(key)}: key '{key}' must be a table, got {type_name(value)}")
        return dict(value)
    if kind in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        for option in options[:-1]:  # the first that takes the value; the last one's error if none does
            try:
                return _convert(option, value, origin, key)
            except ZayaError:
                continue
        return _convert(options[-1], value, origin, key)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2**1000 else math.inf  # float() of a longer integer overflows
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ZayaError(f"{origin.of(key)}: key '{key}' must be a finite number, got {value}")
    if hint in _TYPE_NAMES:
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ZayaError(f"{origin.of(key)}: key '{key}' must be {_TYPE_NAMES[hint]}, got {shown(value)}")
        if hint in (int, float):
            _check_range(value, origin.of(key), key, hint is int)
        return value
    raise ZayaError(f"{origin.of(key)}: key '{key}' has an unsupported value {shown(value)}")


# The range of every number of a run config (the model's fields: zaya.model.config), by its dotted key (N: an
# entry of a list). Each is far beyond any real run (ZAYA1's config among them), and tight enough that a typo, a
# value in the wrong unit or a hostile one is refused in one line instead of training on NaN, filling the memory
# or overflowing what it reaches (a timer, a tensor's size, an int64). A test checks that every int and float key
# has one; docs/configuration.md lists them.
STEPS = 10**12  # steps, and cadences counted in steps
COUNT = 2**62  # tokens and sequences, summed over a run
YEAR_S = 366 * 86_400.0  # a timeout or a time limit of one process
RANKS = 2**20
STEP_TOKENS = 2**32  # tokens of one optimizer step (ZAYA1's: 2**23 to 2**26)
RANGES: dict[str, Range] = {
    "data.seq_len": Range(1, 2**24),
    "data.ramp_start": Range(0, 2**24),
    "data.ramp_increment": Range(0, 2**24),
    "data.ramp_samples": Range(0, COUNT),
    "data.block_size": Range(1, 2**24),
    "data.group_blocks": Range(1, 2**24),
    "train.seed": Range(0, 2**63 - 1),
    "train.max_steps": Range(1, STEPS),
    "train.micro_batch_size": Range(1, 2**16),
    "train.global_batch_size": Range(1, 2**24),
    "train.grad_clip": Range(0.0, 1e6),
    "train.eval_every": Range(0, STEPS),
    "train.eval_batches": Range(1, 2**20),
    "train.max_time_s": Range(0.0, YEAR_S),
    "train.time_budget_s": Range(0.0, 10 * YEAR_S),  # summed over the resumes of a run
    "train.stop_grace_s": Range(0.0, YEAR_S),
    "optim.lr": Range(0.0, 10.0, lo_open=True),
    "optim.weight_decay": Range(0.0, 10.0),
    "optim.adamw_lr": Range(0.0, 10.0, lo_open=True),
    "optim.vector_lr_ratio": Range(0.0, 100.0, lo_open=True),
    "optim.adamw_betas.N": Range(0.0, 1.0, hi_open=True),
    "optim.adamw_eps": Range(1e-30, 1.0),  # smaller rounds to 0 in fp32: 0 / 0 where a state is 0
    "optim.momentum": Range(0.0, 1.0, hi_open=True),
    "optim.ns_steps": Range(1, 99),
    "optim.ns_coefficients.N": Range(-100.0, 100.0),
    "optim.ns_eps": Range(1e-30, 1.0),
    "schedule.total_steps": Range(1, STEPS),
    "schedule.warmup_steps": Range(0, STEPS),
    "schedule.decay_fraction": Range(0.0, 1.0),
    "schedule.min_ratio": Range(0.0, 1.0),
    "balance.kp": Range(0.0, 100.0),
    "balance.ki": Range(0.0, 100.0),
    "balance.kd": Range(0.0, 100.0),
    "checkpoint.every": Range(1, STEPS),
    "checkpoint.keep": Range(1, 10**6),
    "checkpoint.timeout_s": Range(0.0, YEAR_S),
    "logging.log_every": Range(1, STEPS),
    "parallel.dp_replicate": Range(1, RANKS),
    "parallel.dp_shard": Range(1, RANKS, also=-1),
    "parallel.cp": Range(1, 2**12),
    "parallel.ep": Range(1, 2**14),
    "parallel.cp_document_chunks": Range(2, 2**12),
    "parallel.timeout_s": Range(0.0, YEAR_S, lo_open=True),
    "parallel.init_timeout_s": Range(0.0, YEAR_S, lo_open=True),
    "phases.N.tokens": Range(0, COUNT),
    "phases.N.seq_len": Range(0, 2**24),
    "phases.N.lr_scale": Range(0.0, 10.0, lo_open=True),
    "phases.N.rope_theta": Range(1.0, 1e12, also=0.0),
    "phases.N.cp": Range(0, 2**12),
    "phases.N.document_tokens": Range(0, 2**24),
    "phases.N.sources.N.weight": Range(0.0, 1e6, lo_open=True),
}


def range_key(key: str) -> str:
    """The key of `RANGES` for a dotted key: list indices as N (`phases.2.seq_len` -> `phases.N.seq_len`)."""
    return ".".join("N" if part.isdigit() else part for part in key.split("."))


def _check_range(value: int | float, source: str, key: str, integer: bool) -> None:  # source: the file or --set
    bounds = RANGES.get(range_key(key))
    if bounds is not None and not bounds.holds(value):
        kind = "an integer" if integer else "a number"
        raise ZayaError(f"{source}: key '{key}' must be {kind} in {bounds.text(integer)}, got {shown(value)}")


def _validate(config: RunConfig, origin: Origin) -> None:
    """What no single value says: the choices of the string keys, and the keys that must agree (every number is in
    its range by now: `_convert`). A message names the `--set` that gave a key it is about, else the file."""
    model = _checked(config.model_config, origin, "model")  # the preset exists and the overrides make a valid model
    train = config.train
    for key, allowed in (("train.activation_checkpointing", ACTIVATION_CHECKPOINTING), ("train.precision", PRECISIONS),
                         ("logging.wandb_mode", WANDB_MODES), ("balance.error", ("linear", "sign"))):
        value = _lookup(config, key)
        if value not in allowed:
            raise ZayaError(f"{origin.of(key)}: key '{key}' must be one of {', '.join(repr(a) for a in allowed)}, "
                            f"got {shown(value)}")
    _checked(lambda: config.parallel.validate(origin.path), origin, "parallel")
    if train.time_budget_s and config.schedule.kind != "wsd":
        raise ZayaError(f"{origin.of('train.time_budget_s', 'schedule.kind')}: train.time_budget_s needs "
                        f"schedule.kind = 'wsd' (its decay is timed), got {shown(config.schedule.kind)}")
    if train.compile not in COMPILE_CHOICES:
        raise ZayaError(f"{origin.of('train.compile')}: key 'train.compile' must be true, false or \"auto\", got "
                        f"{shown(train.compile)}")
    if train.global_batch_size % train.micro_batch_size:
        raise ZayaError(f"{origin.of('train.global_batch_size', 'train.micro_batch_size')}: train.global_batch_size "
                        f"({train.global_batch_size}) is not a multiple of train.micro_batch_size "
                        f"({train.micro_batch_size})")
    for key in PATH_KEYS:
        for where, value in _values(config, key):
            if "\0" in value:
                raise ZayaError(f"{origin.of(where)}: key '{where}' holds a NUL character, which no path can")
    if not config.data.path and any(not p.sources for p in config.phases or [Phase()]):
        raise ZayaError(f"{origin.of('data.path')}: key 'data.path' is required (or give every phase its sources)")
    names = set()
    for i, phase in enumerate(config.phases):
        problem = phase_name_problem(phase.name)
        if problem:
            raise ZayaError(f"{origin.of(f'phases.{i}.name')}: key 'phases.{i}.name' = {shown(phase.name)}: {problem}")
        if phase.name in names:
            raise ZayaError(f"{origin.of(f'phases.{i}.name')}: phase names must be unique; '{phase.name}' is the name "
                            "of two phases")
        names.add(phase.name)
        if phase.tokens == 0 and i != len(config.phases) - 1:
            raise ZayaError(f"{origin.of(f'phases.{i}.tokens')}: phase '{phase.name}' needs a token budget (only the "
                            "last may be open)")
    if config.train.init_from and config.phases and config.phases[0].init_from:
        raise ZayaError(f"{origin.of('train.init_from', 'phases.0.init_from')}: train.init_from and "
                        "phases.0.init_from both say where the run starts; set one")
    data = config.data
    try:
        ramp_for(data.ramp_start, data.ramp_increment, train.global_batch_size, data.ramp_samples)
    except ZayaError as exc:
        keys = ("data.ramp_start", "data.ramp_increment", "data.ramp_samples", "train.global_batch_size")
        raise ZayaError(f"{origin.of(*keys)}: data.ramp_* with train.global_batch_size: {exc}") from None
    for index, (key, phase) in enumerate(_phase_keys(config)):
        if train.global_batch_size * phase.seq_len > STEP_TOKENS:
            raise ZayaError(f"{origin.of(key, 'train.global_batch_size')}: train.global_batch_size x seq_len = "
                            f"{train.global_batch_size:,} x {phase.seq_len:,} tokens a step (phase '{phase.name}'), "
                            f"more than {STEP_TOKENS:,}")
        _check_documents(config, index, key, phase, model.conv_padding, origin)
    check_positions(config, model, origin)


def _check_documents(config: RunConfig, index: int, key: str, phase: Phase, min_chunk: int, origin: Origin) -> None:
    """A phase that keeps documents apart splits its sequences over its cp ranks into cp x
    `parallel.cp_document_chunks` chunks (`zaya.parallel.context.ContextParallel.for_documents`), each at least
    the convolutions' reach; `document_tokens` means something only for such a phase. `index`: the phase's
    number, `key`: the key its seq_len comes from."""
    if phase.document_tokens and not phase.isolate_documents:
        where = f"phases.{index}.document_tokens"
        raise ZayaError(f"{origin.of(where)}: key '{where}' = {phase.document_tokens}: phase '{phase.name}' does "
                        "not keep documents apart (isolate_documents), so it has no document length to plan for")
    if not phase.isolate_documents or phase.cp == 1:
        return
    chunks = config.parallel.cp_document_chunks
    problem = sequence_split_problem(phase.seq_len, phase.cp, config.parallel.cp_sharding, min_chunk=min_chunk,
                                     chunks_per_rank=chunks)
    if problem:
        cp_key = f"phases.{index}.cp" if config.phases and config.phases[index].cp else "parallel.cp"
        raise ZayaError(f"{origin.of(key, cp_key, 'parallel.cp_document_chunks')}: key '{key}' = {phase.seq_len} "
                        f"with {cp_key} = {phase.cp} and parallel.cp_document_chunks = {chunks} (phase "
                        f"'{phase.name}' keeps documents apart): {problem}")


def _phase_keys(config: RunConfig) -> list[tuple[str, Phase]]:
    """Each resolved phase with the key its seq_len comes from (`phases.N.seq_len`, else `data.seq_len`)."""
    configured = config.phases or [Phase()]
    return [(f"phases.{i}.seq_len" if configured[i].seq_len else "data.seq_len", phase)
            for i, phase in enumerate(config.resolved_phases())]


def check_positions(config: RunConfig, model: ZayaConfig, origin: Origin) -> None:
    """No phase's sequences are longer than `model.max_position_embeddings`. Every attention layer rotates its
    queries and keys by position (RoPE, `partial_rotary_factor` > 0), computed for any position, so nothing
    breaks past the bound at once: but the model, and its export, says it is meant for no longer sequences, and
    the positions beyond it were never trained."""
    for key, phase in _phase_keys(config):
        if phase.seq_len > model.max_position_embeddings:
            blamed = origin.of(key, "model.max_position_embeddings", "model.preset")
            raise ZayaError(f"{blamed}: key '{key}' = {phase.seq_len:,} is longer than "
                            f"model.max_position_embeddings = {model.max_position_embeddings:,} (the longest "
                            "sequence the model is meant for); raise that, or shorten the sequences")


def _checked(check, origin: Origin, table: str):
    """`check()` (a section's own validation, whose messages name the file): a message about a key of `table`
    that a `--set` gave names that `--set` instead. The key is found as the message names it: quoted ('KEY'), or
    a model field by its name."""
    try:
        return check()
    except ZayaError as exc:
        text = str(exc)
        blamed = _about(text, origin, table)
        if blamed == origin.path or not text.startswith(f"{origin.path}: "):
            raise
        raise ZayaError(f"{blamed}: {text[len(origin.path) + 2:]}") from None


def _about(text: str, origin: Origin, table: str) -> str:
    """What a section's message `text` names as its source: the first `--set` of a key of `table` that it is
    about, else the file."""
    for key in origin.sets:
        if key.startswith(table + ".") and _names(text, key[len(table) + 1:]):
            return origin.of(key)
    return origin.path


def _names(text: str, name: str) -> bool:
    """Whether a section's message `text` is about its key `name`: quoted, or as a word (a model field, a key
    that another names), with or without its table."""
    return re.search(rf"(?<![\w.])([\w.]+\.)?{re.escape(name)}(?!\w)", text) is not None


# the keys that name a file or a directory
PATH_KEYS = ("data.path", "train.init_from", "checkpoint.dir", "phases.N.init_from", "phases.N.sources.N.path")
_PHASE_NAME_LENGTH = 128


def phase_name_problem(name: str) -> str | None:
    """What is wrong with `name` as a phase's name (None if nothing): it names the phase in logs, in a checkpoint's
    state and in a file name of the run directory (init_from.NAME.json)."""
    if not name.strip():
        return "a phase needs a name"
    if len(name) > _PHASE_NAME_LENGTH:
        return f"longer than {_PHASE_NAME_LENGTH} characters"
    if not name.isprintable() or "/" in name or "\\" in name or name.startswith("."):
        return "a phase's name is printable, without '/' or '\\', and does not start with '.' (it names a file)"
    return None


def _lookup(config: RunConfig, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _values(config: RunConfig, key: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every entry a `RANGES`-style key (N: each entry of a list) names in `config`."""
    found: list[tuple[str, Any]] = [("", config)]
    for part in key.split("."):
        if part == "N":
            found = [(f"{where}.{i}", item) for where, node in found for i, item in enumerate(node)]
        else:
            found = [(f"{where}.{part}".lstrip("."), getattr(node, part)) for where, node in found]
    return found


def config_from_record(record: dict, source: str) -> RunConfig:
    """The run config a resolved record describes (`ResolvedRun.record`: a run's run_config.json, a checkpoint's
    copy), checked as a loaded file is; `source` names it in messages. A record holds every key, `train.precision`
    and `train.compile` decided, so that it resolves to the run that wrote it."""
    origin = Origin(source)
    config = _build(RunConfig, record, origin, "")
    config.source = source
    _validate(config, origin)
    return config
