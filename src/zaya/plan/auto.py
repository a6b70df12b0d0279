"""`parallel.layout = "auto"`: the layout a run trains in, chosen at launch for the job it has.

At start-up every rank runs the search of `zaya plan --search` (`zaya.plan.search`) for the job's world size,
ranks per node and device (`Cluster`), keeping the layout keys the config gives (`RunConfig.given`), and the
fastest layout that fits becomes the run's: its settings are written into the config (`apply_layout`) before the
run is resolved, so everything after (the mesh, the checkpoints' record, `--print-config`) sees a config like any
other. The decision is said as the `--set` line that pins it, with its prediction and the runner-up's.

It is remembered twice. A resume on as many ranks keeps the layout its checkpoint recorded (`recorded_values`),
however the planner's figures have moved since (a calibration, a new table); on another world size it is planned
anew. And a search already made for the same config, cluster and figures is read back from the cache directory
(`LayoutCache`), so that a relaunch does not search again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zaya.config import LAYOUT_KEYS, RunConfig
from zaya.errors import ZayaError
from zaya.owned import write_output
from zaya.plan.devices import DeviceSpec
from zaya.plan.search import Candidate, Constraints, describe, search_layouts
from zaya.reading import read_json
from zaya.train.run import ResolvedRun

SEARCH_VERSION = 1  # raised when the search or its cost model changes what it picks: older cache entries go unused
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """What a job has: `world_size` ranks, `gpus_per_node` of them per node, each a `device` (its measured `table`
    where it has one)."""

    world_size: int
    gpus_per_node: int
    device: DeviceSpec
    table: Any = None


@dataclass
class Choice:
    """A layout decided: the config it gives, the settings that pin it, what to say, what to record."""

    config: RunConfig
    values: dict[str, Any]  # {"parallel.ep": 8, ..., "phases.2.cp": 8}: what `apply_layout` set
    line: str  # what the run says of it
    record: dict | None = None  # the decision, for the run's config history (None: kept, nothing new)
    runner_up: str = ""  # the runner-up's prediction, for the measured step's check

    @property
    def settings(self) -> list[str]:
        """The `--set` items that pin it (the config keeps what it gives: `RunConfig.given` goes with it)."""
        return pin_line(self.values, self.config)


def layout_values(candidate: Candidate, run: ResolvedRun) -> dict[str, Any]:
    """The layout keys' values of `candidate`, and each phase's cp (`phases.N.cp`, where the config has
    phases)."""
    layout = candidate.layout
    chosen = [cp for cp, searched in zip(candidate.phase_cp, candidate.searched, strict=True) if searched]
    values = {"parallel.dp_replicate": layout.dp_replicate, "parallel.dp_shard": -1,
              "parallel.cp": chosen[0] if chosen else run.parallel.cp, "parallel.ep": layout.ep,
              "parallel.sharding": layout.sharding, "train.micro_batch_size": layout.micro_batch_size,
              "train.activation_checkpointing": layout.activation_checkpointing}
    if run.record.get("phases"):  # the phases whose cp is not `parallel.cp`'s
        values.update({f"phases.{index}.cp": cp for index, cp in enumerate(candidate.phase_cp)
                       if cp != values["parallel.cp"]})
    return values


def apply_layout(config: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`config` with the layout `values` set, but for the keys it gives itself (`RunConfig.given`)."""
    def wanted(key: str) -> bool:
        return key in values and key not in config.given

    sections = {}
    for section in ("parallel", "train"):
        current = getattr(config, section)
        changes = {key.split(".")[1]: values[key] for key in LAYOUT_KEYS if key.startswith(section + ".")
                   and wanted(key)}
        sections[section] = dataclasses.replace(current, **changes)
    phases = [dataclasses.replace(phase, cp=values[f"phases.{i}.cp"]) if wanted(f"phases.{i}.cp") else phase
              for i, phase in enumerate(config.phases)]
    return dataclasses.replace(config, phases=phases, **sections)


def recorded_values(record: dict) -> dict[str, Any] | None:
    """The layout values of a resolved config a checkpoint recorded, if that run chose its layout (`auto`);
    None otherwise, or where the record lacks one of them."""
    parallel, train = record.get("parallel"), record.get("train")
    if not isinstance(parallel, dict) or not isinstance(train, dict) or parallel.get("layout") != "auto":
        return None
    values = {}
    for key in LAYOUT_KEYS:
        section, name = key.split(".")
        value = (parallel if section == "parallel" else train).get(name)
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            return None
        values[key] = value
    phases = record.get("phases")
    for index, phase in enumerate(phases if isinstance(phases, list) else []):
        cp = phase.get("cp") if isinstance(phase, dict) else None
        if not isinstance(cp, int) or isinstance(cp, bool):
            return None
        if cp:  # 0: `parallel.cp`'s
            values[f"phases.{index}.cp"] = cp
    return values


def pin_line(values: dict[str, Any], config: RunConfig) -> list[str]:
    """The `--set` items that give `config` these values (its own keys left out, as it keeps them)."""
    return [f"{key}={value}" for key, value in values.items() if key not in config.given]


def choose(config: RunConfig, run: ResolvedRun, cluster: Cluster, *, cache: LayoutCache | None = None,
           ranked: list[Candidate] | None = None, progress: bool = False) -> Choice:
    """The fastest layout that fits `cluster` for `run` (the config resolved for its world size), within what
    `config` gives; one `ZayaError` naming the smallest memory shortfall if none fits. `ranked`: the search's
    answer, where the caller made it; `cache`: where a search for the same inputs is kept."""
    key = _cache_key(config, run, cluster)
    if ranked is None and cache is not None:
        kept = cache.read(key)
        if kept is not None:
            return _choice(config, kept["values"], kept["line"], kept["record"], kept["runner_up"])
    if ranked is None:
        ranked = search_layouts(run, cluster.gpus_per_node, cluster.device, cluster.table, progress,
                                Constraints.of_config(config, run))
    fitting = [candidate for candidate in ranked if not candidate.reason]
    if not fitting:
        raise ZayaError(f"{config.source}: parallel.layout = \"auto\": {nothing_fits(ranked, cluster)}")
    best, runner = fitting[0], fitting[1] if len(fitting) > 1 else None
    values = layout_values(best, run)
    unit = cluster.device.unit
    settings = pin_line(values, config)
    line = (f"layout auto for {cluster.world_size} x {cluster.device.name} ({cluster.gpus_per_node} per node): "
            f"{' '.join(describe(best).split())}; predicted {_prediction(best, unit)} (ranked first of "
            f"{len(fitting):,} that fit, of {len(ranked):,})"
            + (f"; the runner-up, {' '.join(describe(runner).split())}: {_prediction(runner, unit)}" if runner else "")
            + f"; pin it with {' '.join('--set ' + s for s in settings)}")
    record = {"world_size": cluster.world_size, "gpus_per_node": cluster.gpus_per_node,
              "device": cluster.device.name, "settings": settings, "predicted": _figures(best),
              "runner_up": None if runner is None else {"settings": pin_line(layout_values(runner, run), config),
                                                        "predicted": _figures(runner)},
              "fitting": len(fitting), "weighed": len(ranked)}
    runner_up = "" if runner is None else \
        f"the runner-up, {' '.join(describe(runner).split())}, was predicted {_prediction(runner, unit)}"
    if cache is not None:
        cache.write(key, {"values": values, "line": line, "record": record, "runner_up": runner_up})
    return _choice(config, values, line, record, runner_up)


def _choice(config: RunConfig, values: dict, line: str, record: dict, runner_up: str) -> Choice:
    return Choice(apply_layout(config, values), values, line, record, runner_up)


def _prediction(candidate: Candidate, unit: str) -> str:
    plan = candidate.plan
    memory = max(phase.memory.total for phase in plan.phases)
    return (f"{plan.first.time.total:.3f} s a step, MFU {plan.mfu:.1%}, at most {memory / GB:.2f} GB per {unit}, "
            f"{plan.hours:,.1f} h")


def _figures(candidate: Candidate) -> dict:
    plan = candidate.plan
    return {"step_time_s": plan.first.time.total, "mfu": plan.mfu, "hours": plan.hours,
            "memory_bytes": max(phase.memory.total for phase in plan.phases)}


def nothing_fits(ranked: list[Candidate], cluster: Cluster) -> str:
    """Why no layout of the search can run: the smallest memory shortfall (the layout that comes closest), or, if
    memory is not what keeps them out, the first reason."""
    short = [candidate for candidate in ranked if candidate.shortfall > 0]
    device, gpus = cluster.device, cluster.world_size
    if not short:
        reason = ranked[0].reason if ranked else "the constraints the config gives leave no layout to weigh"
        return f"no layout of {gpus} rank(s) can run it: {reason}"
    closest = min(short, key=lambda candidate: candidate.shortfall)
    more = "" if device.host else "more GPUs, "
    return (f"no layout of {gpus} rank(s) fits the {device.memory_bytes / GB:.2f} GB of a {device.unit}: the "
            f"closest, {' '.join(describe(closest).split())}, is {closest.shortfall / GB:.2f} GB short ("
            f"{closest.reason.split(';')[0]}); {more}shorter sequences or a smaller model would fit")


def _cache_key(config: RunConfig, run: ResolvedRun, cluster: Cluster) -> str:
    """What a choice depends on, hashed: the config (its source aside), what it gives, the job and the device's
    figures."""
    from zaya import __version__

    table = cluster.table.to_dict() if cluster.table is not None else None
    text = json.dumps({"version": SEARCH_VERSION, "zaya": __version__, "config": config.to_dict(),
                       "given": sorted(config.given), "world_size": cluster.world_size,
                       "gpus_per_node": cluster.gpus_per_node, "precision": run.precision,
                       "compile": run.train.compile, "device": dataclasses.asdict(cluster.device), "table": table},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class LayoutCache:
    """Choices kept under the cache directory (`zaya.plan.table.cache_dir`), one file per key. A file that is not
    one zaya wrote there is never read as a choice nor replaced; one that cannot be written costs a search."""

    def __init__(self, cache: Path, writable: bool = True):
        self.root, self.writable = Path(cache) / "layouts", writable

    def _path(self, key: str) -> Path:
        return self.root / f"{key[:24]}.json"

    def read(self, key: str) -> dict | None:
        kept = _kept(self._path(key))
        if not isinstance(kept, dict) or kept.get("key") != key:
            return None
        values, record = kept.get("values"), kept.get("record")
        if not (isinstance(values, dict) and isinstance(record, dict) and isinstance(kept.get("line"), str)
                and isinstance(kept.get("runner_up"), str) and _layout_values_ok(values)):
            return None
        return kept

    def write(self, key: str, choice: dict) -> None:
        if not self.writable:
            return
        path = self._path(key)
        with contextlib.suppress(OSError, ZayaError):
            if os.path.lexists(path) and not _ours(path):
                return  # something else in its place: left alone
            path.parent.mkdir(parents=True, exist_ok=True)
            write_output(path, json.dumps({"key": key, **choice}), overwrite=True)


def _layout_values_ok(values: dict) -> bool:
    keys_ok = all(key in LAYOUT_KEYS or (key.startswith("phases.") and key.endswith(".cp")) for key in values)
    return keys_ok and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values.values())


def _kept(path: Path):
    """The JSON kept at `path`, or None for anything else: missing, not a regular file (never read through: a FIFO
    would block), over 1 MiB, not JSON."""
    try:
        return read_json(path, "kept", "a kept layout", follow_links=False)
    except (OSError, ZayaError):
        return None


def _ours(path: Path) -> bool:
    """Whether `path` holds a choice this cache wrote (for another key of the same prefix, or an older version):
    a JSON object with a key of 64 hex digits."""
    kept = _kept(path)
    key = kept.get("key") if isinstance(kept, dict) else None
    return isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)
