"""`zaya plan --calibrate-from RUN`: what a run measured folded into its device's figures, so that the next
`zaya plan` and the next `zaya train` with `parallel.layout = "auto"` plan with what the device really did.

Every metrics row of a run carries its step's seconds and each rank's peak memory. The planner predicts the same
run (its config as the run resolved it, on as many ranks, from the device's published figures or `zaya shapes`'s
table, uncalibrated), and the two are set side by side:

    compute_factor = median over rows of (measured step - predicted exposed communication) / predicted compute
    memory_factor  = median over phases of (largest measured peak / predicted total)

over the full-batch rows of the run's last start (the layout its config describes), each phase's first
`WARM_UP` left out (compilation, the allocator's first growth). The exposed communication is left as predicted:
one layout's steps do not tell the links' time from the compute's, and the links' figures hold for every
layout while the compute's error (kernels slower than the roofline, a host that cannot keep up) is what a
calibration corrects. On a CPU the measured peak is the process's resident set, the interpreter and torch
included, so the memory is not calibrated there (memory_factor null).

The factors are kept in CACHE/calibration/<device>-<precision>.json (`zaya.plan.table.cache_dir`), and
`calibrated` gives the device with them (`StepTime.scaled`, `Memory.scaled` apply them in the planner). A file
there that zaya did not write is never replaced; deleting the file, or `zaya plan --uncalibrated`, plans with the
published (or measured) figures alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zaya.errors import ZayaError
from zaya.plan.devices import DeviceSpec
from zaya.reading import read_json, read_json_object, read_lines
from zaya.schema import Fields, is_a, shown

FORMAT = "zaya-calibration"
FORMAT_VERSION = 1
MIN_ROWS = 5  # measured steps a calibration needs: fewer say more about the warm-up than the device
WARM_UP = 2  # each phase's first full-batch rows of a start: compilation, the allocator's first growth
FACTOR_RANGE = (0.05, 20.0)  # beyond these a run measured something else (another device, a stalled filesystem)
LISTED = 64  # calibration files `zaya plan --devices` lists
PRECISIONS = ("bf16", "fp32")
GB = 1e9
# how the trainer says a start resumed (zaya.train.trainer): its step bounds the last start's rows
_RESUMED = re.compile(r"^\S+ \S+ resumed from .* \(step (\d+), phase '")


def calibration_path(cache: Path, device: str, precision: str) -> Path:
    """Where the calibration of `device` in `precision` is kept under the cache directory `cache`."""
    return Path(cache) / "calibration" / f"{device}-{precision}.json"


@dataclass(frozen=True)
class Calibration:
    """One calibration file's fields."""

    device: str
    precision: str
    compute_factor: float
    memory_factor: float | None  # None: not calibrated (a CPU's peak is its resident set)
    run: str  # the run directory it was measured in
    rows: int  # the metrics rows it is the median of
    gpus: int  # the run's ranks
    measured_step_s: float  # median measured step
    predicted_step_s: float  # median predicted step of the same rows, uncalibrated
    measured_at: str  # ISO date-time of the calibration
    zaya_version: str

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data, source: str) -> Calibration:
        """The calibration of a parsed file; anything else is one `ZayaError` naming `source` and the field."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ZayaError(f"{source}: not a calibration zaya wrote (`zaya plan --calibrate-from RUN` writes one)")
        if data.get("version") != FORMAT_VERSION:
            raise ZayaError(f"{source}: calibration format version {shown(data.get('version'))}, this zaya reads "
                            f"version {FORMAT_VERSION}: calibrate again, or delete the file")
        doc = Fields(data, source)
        low, high = FACTOR_RANGE
        memory = None if data.get("memory_factor", 0) is None else doc.float("memory_factor", lo=low, hi=high)
        return cls(device=doc.str("device", max_len=64), precision=doc.str("precision", choices=PRECISIONS),
                   compute_factor=doc.float("compute_factor", lo=low, hi=high), memory_factor=memory,
                   run=doc.str("run", max_len=4096), rows=doc.int("rows", lo=MIN_ROWS, hi=2**62),
                   gpus=doc.int("gpus", lo=1, hi=2**20),
                   measured_step_s=_positive(doc, "measured_step_s"),
                   predicted_step_s=_positive(doc, "predicted_step_s"),
                   measured_at=doc.str("measured_at", max_len=64), zaya_version=doc.str("zaya_version", max_len=64))


def _positive(doc: Fields, name: str) -> float:
    value = doc.float(name, lo=0.0, hi=1e9)
    if value <= 0:
        raise ZayaError(f"{doc.source}: field '{name}' must be a number of seconds above 0, got {shown(value)}")
    return value


def _file_data(path: Path):
    """The parsed JSON of a calibration file: a regular file (never read through a link, never a FIFO) of at
    most 1 MiB."""
    return read_json(path, "kept", "a calibration file", follow_links=False)


def read_calibration(path: Path) -> Calibration:
    """The calibration kept at `path`; a file that is not one, or one with a field missing, of the wrong type or
    out of range, is one `ZayaError` naming the file and the field."""
    return Calibration.from_dict(_file_data(Path(path)), str(path))


def calibrated(spec: DeviceSpec, cache: Path, precision: str) -> DeviceSpec:
    """`spec` with the factors of its calibration in `precision` under the cache directory `cache`, if there is
    one (its label says so); `spec` as it is otherwise. An unusable calibration file is one `ZayaError`."""
    path = calibration_path(cache, spec.name, precision)
    if not os.path.lexists(path):
        return spec
    found = read_calibration(path)
    for name, want in (("device", spec.name), ("precision", precision)):
        if getattr(found, name) != want:
            raise ZayaError(f"{path}: field '{name}' is {shown(getattr(found, name))}, but the file is the "
                            f"calibration of {want}; calibrate again, or delete the file")
    return dataclasses.replace(spec, compute_factor=found.compute_factor, memory_factor=found.memory_factor or 1.0,
                               calibrated_from=found.run, label=f"{spec.label}, calibrated from {found.run}")


def describe_calibrations(cache: Path) -> list[str]:
    """The calibrations kept under `cache`, one line each, for `zaya plan --devices` (an unusable file is listed
    with why)."""
    directory = Path(cache) / "calibration"
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(".json"))
    except OSError:  # none made yet, or not a directory to read: nothing calibrated
        names = []
    if not names:
        return [f"calibrations: none ({directory}; `zaya plan --calibrate-from RUN --device NAME` makes one)"]
    lines = [f"calibrations ({directory}; delete a file, or plan with --uncalibrated, to plan without it):"]
    for name in names[:LISTED]:
        try:
            found = read_calibration(directory / name)
        except ZayaError as exc:
            lines.append(f"  {name}: unusable ({exc})")
            continue
        memory = "-" if found.memory_factor is None else f"x{found.memory_factor:.3f}"
        lines.append(f"  {found.device:<8} {found.precision:<5} compute x{found.compute_factor:.3f}  memory "
                     f"{memory}  from {found.run} ({found.rows} steps on {found.gpus} rank(s), "
                     f"{found.measured_at[:10]})")
    if len(names) > LISTED:
        lines.append(f"  ... and {len(names) - LISTED} more")
    return lines


# ---- the run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """What a calibration takes from a metrics row."""

    step: int
    phase: str
    batch_size: int
    seconds: float
    world: int
    peak: int  # the largest rank's peak memory, bytes


def run_config(run_dir: Path):
    """The run's config as it resolved it: the newest checkpoint's copy (a resume's changes included), else
    run_config.json."""
    from zaya.checkpoint import STEP_DIR
    from zaya.config import config_from_record
    from zaya.run_dir import CHECKPOINTS_DIR, RUN_CONFIG_FILE
    from zaya.train.inputs import read_saved

    original = run_dir / RUN_CONFIG_FILE
    record = read_json_object(original, "document", "a run's config") if os.path.lexists(original) else None
    roots = [run_dir / CHECKPOINTS_DIR]
    section = record.get("checkpoint") if record is not None else None
    if isinstance(section, dict) and isinstance(section.get("dir"), str) and section["dir"]:
        roots.insert(0, Path(section["dir"]))  # `checkpoint.dir`: the run's checkpoints are kept there
    for root in roots:
        try:
            steps = [(int(m.group(1)), entry.path) for entry in os.scandir(root)
                     if (m := STEP_DIR.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False)]
        except OSError:  # no checkpoints there
            continue
        if steps:
            newest = Path(max(steps)[1])
            saved = read_saved(newest)
            if saved.config:
                return config_from_record(saved.config, f"{newest}/train_state.json")
    if record is None:
        raise ZayaError(f"{run_dir}: neither a checkpoint with its config nor {RUN_CONFIG_FILE}: not the directory "
                        "of a run zaya trained")
    return config_from_record(record, str(original))


def last_resume(run_dir: Path) -> int:
    """The step the run's last start resumed from, as its train.log says (0: it never resumed, or no log)."""
    from zaya.run_dir import LOG_FILE

    path = run_dir / LOG_FILE
    step = 0
    if not os.path.lexists(path):
        return step
    for line in read_lines(path, "a training log"):
        found = _RESUMED.match(line)
        if found:
            step = int(found.group(1))
    return step


def _row(row: dict) -> Row | None:
    """The fields of a metrics row a calibration needs, or None if it lacks one (a row of an older zaya)."""
    peaks, seconds = row.get("peak_memory_bytes"), row.get("step_time")
    if not (isinstance(peaks, list) and peaks and all(is_a(peak, int) for peak in peaks)):
        return None
    if not (is_a(row.get("step"), int) and is_a(row.get("batch_size"), int) and isinstance(row.get("phase"), str)):
        return None
    if not is_a(seconds, (int, float)) or seconds <= 0:
        return None
    if row.get("skipped") is True:  # no optimizer step: not the step the plan is of
        return None
    return Row(row["step"], row["phase"], row["batch_size"], float(seconds), len(peaks), max(peaks))


def measured_rows(run_dir: Path, global_batch: int) -> list[Row]:
    """The rows of the run's last start (after its last resume; a row of another world size, or a step that does
    not rise, starts another) at the full batch, each phase's first `WARM_UP` left out."""
    from zaya.train.metrics import iter_metrics

    after = last_resume(run_dir)
    kept: list[Row] = []
    seen: dict[str, int] = {}  # the start's full-batch rows so far, by phase
    last = None
    for raw in iter_metrics(run_dir):
        row = _row(raw)
        if row is None or row.step <= after:
            continue
        if last is not None and (row.world != last.world or row.step <= last.step):
            kept, seen = [], {}
        last = row
        if row.batch_size == global_batch:
            seen[row.phase] = seen.get(row.phase, 0) + 1
            if seen[row.phase] > WARM_UP:
                kept.append(row)
    return kept


# ---- the calibration ----------------------------------------------------------------------------------------


def check_replaceable(path: Path) -> None:
    """Refuse to write the calibration at `path` over anything but a calibration zaya wrote: a link, FIFO or
    directory is never replaced, nor a regular file that is not one of zaya's calibrations."""
    from zaya.owned import check_output

    check_output(path, overwrite=True)
    if not os.path.lexists(path):
        return
    try:
        ours = isinstance(data := _file_data(path), dict) and data.get("format") == FORMAT
    except ZayaError:
        ours = False
    if not ours:
        raise ZayaError(f"{path}: exists and is not a calibration zaya wrote; refusing to replace it (move it "
                        "away to calibrate)")


def _clamped(value: float) -> float:
    low, high = FACTOR_RANGE
    return min(max(value, low), high)


def calibrate(run_dir: Path, cache: Path, target: Callable[[str], tuple[DeviceSpec, Any]],
              gpus_per_node: int | None = None) -> tuple[Calibration, Path, str]:
    """Calibrate the device `target(precision)` gives, uncalibrated, with its measured table if it has one (the
    precision is the run's), from the run in `run_dir` (module docstring), and keep the result under `cache`;
    returns it, its path and the line that says what was measured against what. Nothing is written unless
    everything succeeded."""
    import zaya
    from zaya.owned import make_parent, write_output
    from zaya.plan.planner import plan_compile, plan_run
    from zaya.run_dir import METRICS_FILE

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "not a directory" if os.path.lexists(run_dir) else "no such directory"
        raise ZayaError(f"{run_dir}: {what}; --calibrate-from takes the directory of a run zaya trained")
    if not os.path.lexists(run_dir / METRICS_FILE):
        raise ZayaError(f"{run_dir}: no {METRICS_FILE}: not the directory of a run zaya trained, or one that logged "
                        "no step")
    config = run_config(run_dir)
    precision = config.train.precision
    if precision not in PRECISIONS:
        raise ZayaError(f"{config.source}: field 'train.precision' is {shown(precision)}, not a decided precision "
                        f"({', '.join(PRECISIONS)})")
    device, table = target(precision)
    path = calibration_path(cache, device.name, precision)
    check_replaceable(path)  # before the work, and again just before the write
    rows = measured_rows(run_dir, config.train.global_batch_size)
    if len(rows) < MIN_ROWS:
        raise ZayaError(f"{run_dir / METRICS_FILE}: {len(rows)} full-batch step(s) of the run's last start after "
                        f"each phase's first {WARM_UP}, fewer than the {MIN_ROWS} a calibration needs: train longer "
                        "(or log every step: logging.log_every = 1)")
    world = rows[-1].world
    run = config.resolve(world, precision, plan_compile(device.name, table))  # as the run compiled, or did not
    plan = plan_run(run, device, table, gpus_per_node or min(device.gpus_per_node, world))
    phases = {phase.name: phase for phase in plan.phases}
    rows = [row for row in rows if row.phase in phases]
    if len(rows) < MIN_ROWS:
        raise ZayaError(f"{config.source}: the measured rows' phases are not the config's "
                        f"({', '.join(phases)}): its phases changed since; calibrate from a run of this config")
    ratios = []
    for row in rows:
        time = phases[row.phase].time
        if time.compute <= 0:
            raise ZayaError(f"{config.source}: the plan on {device.name} predicts no compute for phase "
                            f"'{row.phase}': nothing to calibrate")
        ratios.append((row.seconds - time.comm_exposed) / time.compute)
    compute = _clamped(statistics.median(ratios))
    memory, said = _memory(rows, phases, device)
    found = Calibration(device=device.name, precision=precision, compute_factor=compute, memory_factor=memory,
                        run=str(run_dir.resolve()), rows=len(rows), gpus=world,
                        measured_step_s=statistics.median(row.seconds for row in rows),
                        predicted_step_s=statistics.median(phases[row.phase].time.total for row in rows),
                        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        zaya_version=zaya.__version__)
    make_parent(path)
    check_replaceable(path)
    write_output(path, json.dumps(found.to_dict(), indent=1) + "\n", overwrite=True)
    line = (f"calibrated {device.name} ({precision}) from {run_dir}: step {found.measured_step_s:.4g} s measured "
            f"(median of {found.rows} steps on {world} rank(s)) against {found.predicted_step_s:.4g} s "
            f"predicted: compute x{compute:.3f}; {said}; kept in {path}: `zaya plan` and `zaya train` with "
            "parallel.layout = \"auto\" now plan with it (--uncalibrated, or deleting the file, plans without)")
    return found, path, line


def _memory(rows: list[Row], phases: dict, device: DeviceSpec) -> tuple[float | None, str]:
    """(memory_factor or None, what the line says of it)."""
    if device.host:
        return None, "memory not calibrated (on a CPU the peak is the process's resident set, the interpreter " \
                     "included)"
    peaks: dict[str, int] = {}
    for row in rows:
        peaks[row.phase] = max(peaks.get(row.phase, 0), row.peak)
    if any(peak <= 0 for peak in peaks.values()) or any(phases[name].memory.total <= 0 for name in peaks):
        return None, "memory not calibrated (the run measured no peak memory)"
    factor = _clamped(statistics.median(peak / phases[name].memory.total for name, peak in peaks.items()))
    name = max(peaks, key=peaks.get)
    return factor, (f"peak memory {peaks[name] / GB:.2f} GB measured against {phases[name].memory.total / GB:.2f} "
                    f"GB predicted{f' (phase {name!r})' if len(peaks) > 1 else ''}: memory x{factor:.3f}")
