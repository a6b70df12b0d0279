"""A run's line-oriented logs as `zaya report` reads them: `metrics.jsonl`, `evals.jsonl` and `incidents.jsonl`.

Each is read as a stream (`zaya.reading.bounded_lines`): the file must be a regular file (a FIFO or a device is
one line, never a wait or an endless read), each line is cut at a length bound, and only a bounded number of rows
is held, however long the file:

    metrics.jsonl     lines up to 1 MiB; at most 4,096 rows held, spread evenly over the run (every 2nd, 4th,
                      ... row once there are more), plus the last row, the last with a loss, the best loss, the
                      last held-out loss and the last with a token count; the peak memory is taken over every row
    evals.jsonl       lines up to 1 MiB; the newest 4,096 records, and at most 100,000 metric values in all
    incidents.jsonl   lines up to 64 KiB; the newest 4,096 records, each text field cut to 1,000 characters

The report is made from the rows that can be read. A file whose first line is not a JSON object is not a log of
its kind: that is one error naming it. After the first line, a row that is not JSON, is cut by the line bound
or has a field of the wrong type is skipped, and one warning per file says how many and names the first; a torn
last line (a writer killed mid-line) is left out without a word.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zaya.errors import ZayaError
from zaya.reading import LINE_CAP, MiB, bounded_lines, open_regular, os_reason, parse_json
from zaya.run_dir import EVALS_FILE, METRICS_FILE
from zaya.schema import INT_BOUND, Fields, shown

METRICS_LINE = MiB  # a row of 80 layers x 64 experts' loads takes about 100 KiB
EVALS_LINE = MiB
INCIDENTS_LINE = LINE_CAP
MAX_ROWS = 4096  # metrics rows held: a plot 800 pixels wide shows no more
MAX_RECORDS = 4096  # evaluations or incidents held, the newest
MAX_FIGURES = 100_000  # metric values of all the evaluations held
MAX_TEXT = 1000  # characters kept of an incident's text field (the timeline shows 160)
MAX_RANKS = 1 << 17  # entries of a per-rank list (`peak_memory_bytes`): `zaya plan`'s largest job
HEATMAP_CELLS = 8192  # layers x experts of an `expert_load` kept for the heatmap: 128 layers of 64 experts


@dataclass
class Log:
    """What was read of one log: its rows (as held) and what was left out."""

    path: Path
    what: str
    rows: list[dict] = field(default_factory=list)
    read: int = 0  # rows read (skipped ones included)
    skipped: int = 0  # rows left out for what they hold
    first_skipped: str = ""  # why the first of them was
    dropped: int = 0  # good rows not held (beyond the bounds)
    peak_memory: list[int] = field(default_factory=list)  # metrics: per rank, over every row read

    def warnings(self) -> list[str]:
        notes = []
        if self.skipped:
            notes.append(f"{self.path}: skipped {self.skipped:,} of {self.read:,} {self.what} ({self.first_skipped})")
        if self.dropped and self.what != "metrics rows":  # metrics are thinned, not lost: the summary says so
            notes.append(f"{self.path}: only the newest {len(self.rows):,} of {self.read - self.skipped:,} "
                         f"{self.what} are shown")
        return notes


def json_rows(path: Path, what: str, max_line: int) -> Iterator[tuple[int, Any, str]]:
    """(line number, JSON value, "") for each line of `path` that parses, (line number, None, why) for each that
    does not; blank lines are passed over, and so is a last line that looks torn (the start of an object whose
    writer was killed). A first line that is not a JSON object is one `ZayaError`: not a log of its kind."""
    pending: tuple[int, Any, str] | None = None  # a line that did not parse: left out if it is the last and torn
    torn = False
    seen = False
    with open_regular(path, what) as handle:
        try:
            for number, line in enumerate(bounded_lines(handle, max_line), 1):
                if not line.strip():
                    continue
                if pending is not None:
                    yield pending
                    pending = None
                value, problem = _parse(line, number, max_line)
                if not seen and not isinstance(value, dict) and (
                        value is not None or not line.lstrip().startswith(b"{")):
                    raise ZayaError(f"{path}: not {what} (line {number} is not a JSON object)")
                seen = True
                if value is None:
                    pending = (number, None, problem)
                    torn = line.lstrip().startswith(b"{") and len(line) < max_line
                else:
                    yield number, value, ""
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    if pending is not None and not torn:
        yield pending


def _parse(line: bytes, number: int, max_line: int) -> tuple[Any, str]:
    if len(line) >= max_line:
        return None, f"line {number}: longer than {max_line // 1024:,} KiB"
    try:
        return parse_json(line, f"line {number}"), ""
    except ZayaError as exc:
        return None, str(exc)


def read_log(path: Path, what: str, max_line: int, check: Callable[[Fields], dict | None],
             hold: Callable[[Log, dict], None]) -> Log:
    """Stream `path` through `check` (a row as it is held, or `ZayaError` to skip it) into `hold` (which keeps
    it, or not)."""
    log = Log(Path(path), what)
    for number, value, problem in json_rows(log.path, what, max_line):
        log.read += 1
        if value is not None and not isinstance(value, dict):
            problem = f"line {number}: not a JSON object"
        if not problem:
            try:
                row = check(Fields(value, f"line {number}"))
            except ZayaError as exc:
                problem = str(exc)
            else:
                hold(log, row)
                continue
        log.skipped += 1
        log.first_skipped = log.first_skipped or problem
    return log


# ---- fields ---------------------------------------------------------------------------------------------


def number(doc: Fields, name: str) -> float | int | None:
    """A number field (NaN and infinities allowed: a diverged loss is logged as NaN), or None if absent or null;
    an integer must be within +-2**63."""
    value = doc.data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, int) and not -INT_BOUND <= value < INT_BOUND):
        raise ZayaError(f"{doc.source}: field '{doc.key(name)}' must be a number, got {shown(value)}")
    return value


def count(doc: Fields, name: str) -> int | None:
    """A non-negative integer field, or None if absent or null."""
    return None if doc.data.get(name) is None else doc.int(name, lo=0)


def text(doc: Fields, name: str) -> str | None:
    """A string field cut to `MAX_TEXT` characters, or None if absent or null."""
    value = doc.data.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ZayaError(f"{doc.source}: field '{doc.key(name)}' must be a string, got {shown(value)}")
    return value[:MAX_TEXT]


# ---- metrics.jsonl ------------------------------------------------------------------------------------------

METRIC_NUMBERS = ("loss", "eval_loss", "eval_ppl", "lr", "batch_size", "tokens", "tokens_per_s", "mfu", "time",
                  "step_time")


class _Metrics:
    """The rows of a metrics log as held: thinned to `MAX_ROWS` by doubling the stride, and the pinned ones."""

    def __init__(self) -> None:
        self.kept: list[tuple[int, dict]] = []
        self.stride = 1
        self.index = 0
        self.pins: dict[str, tuple[int, dict]] = {}
        self.heatmap_shape: tuple[int, int] | None = None

    def check(self, doc: Fields) -> dict:
        row: dict[str, Any] = {"step": doc.int("step", lo=0)}
        for name in METRIC_NUMBERS:
            value = number(doc, name)
            if value is not None:
                row[name] = value
        memory = doc.data.get("peak_memory_bytes")
        if memory is not None:
            ranks = memory if isinstance(memory, list) else [memory]
            if len(ranks) > MAX_RANKS:
                raise ZayaError(f"{doc.source}: field 'peak_memory_bytes' must list at most {MAX_RANKS:,} ranks, got "
                                f"{len(ranks):,}")
            for rank, value in enumerate(ranks):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < INT_BOUND:
                    raise ZayaError(f"{doc.source}: field 'peak_memory_bytes.{rank}' must be a number of bytes in "
                                    f"0..2**63, got {shown(value)}")
            row["peak_memory_bytes"] = ranks
        load = self._expert_load(doc)
        if load is not None:
            row["expert_load"] = load
        return row

    def _expert_load(self, doc: Fields) -> np.ndarray | None:
        value = doc.data.get("expert_load")
        if value is None:
            return None
        wrong = ZayaError(f"{doc.source}: field 'expert_load' must be a list of equally long lists of numbers (layers "
                          f"x experts), got {shown(value)}")
        if not isinstance(value, list) or not value or not all(isinstance(layer, list) for layer in value):
            raise wrong
        experts = len(value[0])
        if not experts or any(len(layer) != experts for layer in value):
            raise wrong
        if len(value) * experts > HEATMAP_CELLS:
            return None  # too many to draw: no heatmap, the rest of the row stands
        for layer in value:
            for item in layer:
                if isinstance(item, bool) or not isinstance(item, (int, float)) or (
                        isinstance(item, int) and not -INT_BOUND <= item < INT_BOUND):
                    raise wrong
        shape = (len(value), experts)
        if self.heatmap_shape is None:
            self.heatmap_shape = shape
        elif shape != self.heatmap_shape:
            raise ZayaError(f"{doc.source}: field 'expert_load' is {shape[0]} x {shape[1]}, the rows before it "
                            f"{self.heatmap_shape[0]} x {self.heatmap_shape[1]}")
        # a fraction of the tokens: what lies outside [0, 1] (an overflow, garbage) is drawn at the nearest bound
        return np.clip(np.array(value, dtype=np.float64), 0.0, 1.0).astype(np.float32)

    def hold(self, log: Log, row: dict) -> None:
        memory = row.pop("peak_memory_bytes", None)
        if memory is not None:
            if len(memory) > len(log.peak_memory):
                log.peak_memory.extend([0] * (len(memory) - len(log.peak_memory)))
            for rank, value in enumerate(memory):
                log.peak_memory[rank] = max(log.peak_memory[rank], int(value))
        index, self.index = self.index, self.index + 1
        entry = (index, row)
        self.pins["last"] = entry
        loss = row.get("loss")
        if loss is not None and not math.isnan(loss):
            self.pins["last_loss"] = entry
            best = self.pins.get("best")
            if best is None or loss < best[1]["loss"]:
                self.pins["best"] = entry
        eval_loss = row.get("eval_loss")
        if eval_loss is not None and not math.isnan(eval_loss):
            self.pins["last_eval"] = entry
        if row.get("tokens") is not None:
            self.pins["last_tokens"] = entry
        if index % self.stride:
            log.dropped += 1
            return
        self.kept.append(entry)
        if len(self.kept) > MAX_ROWS:
            log.dropped += len(self.kept) - len(self.kept[::2])
            self.kept = self.kept[::2]
            self.stride *= 2

    def rows(self) -> list[dict]:
        entries = dict(self.kept)
        entries.update(self.pins.values())
        return [entries[index] for index in sorted(entries)]


def read_metrics_log(run_dir: Path) -> Log:
    """The metrics log of a run as the report holds it (see the module docstring); no file: no rows."""
    path = Path(run_dir) / METRICS_FILE
    if not exists(path):
        return Log(path, "metrics rows")
    metrics = _Metrics()
    log = read_log(path, "a metrics log", METRICS_LINE, metrics.check, metrics.hold)
    log.what = "metrics rows"
    log.rows = metrics.rows()
    log.dropped = log.read - log.skipped - len(log.rows)
    return log


# ---- evals.jsonl ----------------------------------------------------------------------------------------------


def _eval_record(doc: Fields) -> dict:
    record: dict[str, Any] = {}
    for name in ("time", "loss", "ppl", "limit"):
        if name in doc:
            record[name] = number(doc, name)
    for name in ("step", "seq_len", "num_fewshot", "max_batches"):
        if name in doc:
            record[name] = count(doc, name)
    for name in ("kind", "split", "model", "data", "results_file"):
        if name in doc:
            record[name] = text(doc, name)
    if doc.data.get("tasks") is not None:
        tasks = {}
        for task, metrics in doc.dict("tasks").items():
            if metrics is None:
                continue
            if not isinstance(metrics, dict):
                raise ZayaError(f"{doc.source}: field 'tasks.{task[:80]}' must be an object, got {shown(metrics)}")
            # only numbers are shown ("N/A" standard errors and aliases are not)
            tasks[task[:MAX_TEXT]] = {key[:MAX_TEXT]: value for key, value in metrics.items()
                                      if not isinstance(value, bool) and isinstance(value, (int, float))
                                      and -INT_BOUND <= value < INT_BOUND}
        record["tasks"] = tasks
    return record


def _figures(record: dict) -> int:
    return 2 + sum(len(metrics) for metrics in (record.get("tasks") or {}).values())


def read_evals_log(run_dir: Path) -> Log:
    """RUN_DIR/evals.jsonl as the report holds it (see the module docstring); no file: no records."""
    path = Path(run_dir) / EVALS_FILE
    if not exists(path):
        return Log(path, "evaluation records")
    held: deque[dict] = deque()
    figures = 0

    def hold(log: Log, record: dict) -> None:
        nonlocal figures
        held.append(record)
        figures += _figures(record)
        while len(held) > MAX_RECORDS or (figures > MAX_FIGURES and len(held) > 1):
            figures -= _figures(held.popleft())
            log.dropped += 1

    log = read_log(path, "an evaluation log", EVALS_LINE, _eval_record, hold)
    log.what, log.rows = "evaluation records", list(held)
    return log


# ---- incidents.jsonl --------------------------------------------------------------------------------------------

INCIDENT_TEXTS = ("event", "signal", "subject", "action", "outcome", "source", "detail")


def _incident(doc: Fields) -> dict:
    """An incident record with the fields the report shows, of the types it needs (`time` is required: the
    timeline is ordered by it)."""
    record: dict[str, Any] = {"time": doc.str("time", max_len=64)}
    for name in INCIDENT_TEXTS:
        value = text(doc, name)
        if value is not None:
            record[name] = value
    for name in ("step", "attempt"):
        if doc.data.get(name) is not None:
            record[name] = doc.int(name)
    evidence = doc.data.get("evidence")
    if evidence is not None:
        lines = doc.list("evidence", of=str)
        record["evidence"] = [line[:MAX_TEXT] for line in lines[:1]]
    return record


def read_incidents_log(path: Path) -> Log:
    """An `incidents.jsonl` as the report holds it (see the module docstring)."""
    held: deque[dict] = deque()

    def hold(log: Log, record: dict) -> None:
        held.append(record)
        if len(held) > MAX_RECORDS:
            held.popleft()
            log.dropped += 1

    log = read_log(Path(path), "an incident log", INCIDENTS_LINE, _incident, hold)
    log.what, log.rows = "incident records", list(held)
    return log


def exists(path: Path) -> bool:
    """Whether there is anything at `path` (a dangling link counts: reading it says what is wrong)."""
    try:
        path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    return True
