"""Heartbeats: each rank says which section it is in, the supervisor notices when one stops saying it.

Worker side (`Heartbeat`): on entering a section (`init`, `checkpoint_load`, `step`, `eval`,
`checkpoint_save`, and `done` at the end) a rank rewrites one small JSON file, `rank-N.json`, atomically
(write, then rename): the section, the step, the wall time, its pid, and the longest recent duration of each
section it has finished. That is one `open`/`write`/`rename` per step, no collective, no device sync: the
hot path does not notice it. The trainer writes heartbeats only when its supervisor asked for them
(`zaya.resilience.supervision`).

Supervisor side (`HeartbeatWatcher`): a rank in section S since time t is hung when

    now - t > timeout(S) = max(floor_s, factor x longest recent duration of S)

and, before S has a measured duration, when `now - t > first_timeout_s` (the first step compiles and warms
up; `init` has its own `init_timeout_s`, counted from the group's start while no file exists yet). The
durations come from the ranks themselves: the recent window of each section, leaving out its first pass
(the warm-up), and the longest over all ranks, since they step together. So the timeout tracks the run's
real step time: a 1 s step is declared hung after a few seconds, not after the 30-minute collective timeout.

The directory is read every poll and may hold anything: a file is a heartbeat only if it is named `rank-N.json`,
is a regular file (not followed through a link, opened without blocking: a FIFO planted there is never read)
of at most 64 KiB, and is a JSON object with every field of its type and in range. Anything else is ignored,
with a note once per file (`HeartbeatWatcher(note=...)`), as a garbled file is. A writer's temporary file has a
name of its own process (`.rank-N.PID-TOKEN.tmp`, created exclusively), so nothing planted is written through.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import parse_json, read_bytes
from zaya.resilience.findings import Finding
from zaya.resilience.processes import process_state

SECTIONS = ("init", "checkpoint_load", "step", "eval", "checkpoint_save", "done")
WINDOW = 32  # recent durations kept per section
BEAT_NAME = re.compile(r"rank-(\d{1,7})\.json")
TMP_NAME = re.compile(r"\.rank-\d{1,7}\.[0-9]+-[0-9a-f]+\.tmp")  # a writer's temporary file
MAX_BEAT_FILES = 65536  # heartbeat files read per poll (a node runs at most 1,024 ranks)
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT


class Heartbeat:
    """A rank's heartbeat writer; inert when `directory` is None."""

    def __init__(self, directory: str | Path | None, rank: int):
        self.directory = Path(directory) if directory else None
        self.rank = rank
        self._section: str | None = None
        self._since = 0.0
        self._recent: dict[str, deque[float]] = {}
        self._warmed: set[str] = set()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._path = self.directory / f"rank-{rank}.json"
            self._tmp = self.directory / f".rank-{rank}.{os.getpid()}-{secrets.token_hex(4)}.tmp"

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def __call__(self, event: str, step: int, path: Path | None = None) -> None:
        """As a trainer listener: a beat for each section the trainer enters; its other events are no sections."""
        if event in SECTIONS:
            self.beat(event, step)

    def beat(self, section: str, step: int) -> None:
        """Enter `section` at `step` (the number of completed optimizer steps)."""
        if self.directory is None:
            return
        if section not in SECTIONS:
            raise ValueError(f"unknown heartbeat section '{section}'")
        now = time.time()
        if self._section in self._warmed:
            self._recent.setdefault(self._section, deque(maxlen=WINDOW)).append(now - self._since)
        elif self._section is not None:
            # the first pass through a section is its warm-up (compilation, allocator, page cache): it has
            # `first_timeout_s`, and would loosen every later timeout if it calibrated them
            self._warmed.add(self._section)
        self._section, self._since = section, now
        record = {"rank": self.rank, "pid": os.getpid(), "section": section, "step": step, "time": now,
                  "longest": {name: max(values) for name, values in self._recent.items()}}
        # created exclusively and never through a link: the name is this process's own
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(record))
        os.replace(self._tmp, self._path)


@dataclass
class HeartbeatSettings:
    """How long a section may last before its rank counts as hung."""

    factor: float = 5.0
    floor_s: float = 30.0
    first_timeout_s: float = 900.0  # a section with no measured duration yet (the first step compiles)
    init_timeout_s: float = 900.0  # from the group's start to a rank's first heartbeat, and for `init`

    def timeout(self, section: str, longest: dict[str, float]) -> tuple[float, str]:
        """The timeout of `section` and how it was reached, for the incident's evidence."""
        if section == "done":
            return float("inf"), "finished"
        if section == "init":
            return self.init_timeout_s, "init timeout"
        if section not in longest:
            return self.first_timeout_s, "first occurrence"
        calibrated = self.factor * longest[section]
        if calibrated < self.floor_s:
            return self.floor_s, f"floor; {self.factor:g} x {longest[section]:.2f} s = {calibrated:.2f} s"
        return calibrated, f"{self.factor:g} x longest recent {longest[section]:.2f} s"


def valid_beat(record) -> bool:
    """Whether `record` has every field of a heartbeat with a value of its type and in range (a file in the directory
    that is not one of ours is ignored, never trusted)."""
    def count(value, bound: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound

    def seconds(value, bound: float) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
            abs(value) < bound

    longest = record.get("longest", {}) if isinstance(record, dict) else None
    return (isinstance(record, dict) and count(record.get("rank"), 1 << 20) and count(record.get("pid"), PID_MAX)
            and record["pid"] > 0 and isinstance(record.get("section"), str) and len(record["section"]) <= 64
            and count(record.get("step"), 1 << 63) and seconds(record.get("time"), 1e11)
            and isinstance(longest, dict) and len(longest) <= len(SECTIONS)
            and all(isinstance(k, str) and seconds(v, 1e9) and v >= 0 for k, v in longest.items()))


def read_beats(directory: Path, problems: dict[str, str] | None = None) -> dict[int, dict]:
    """Every rank's latest heartbeat in `directory`, by rank; a file that is not a heartbeat is left out, and why
    goes into `problems` (by path) when given."""
    beats: dict[int, dict] = {}
    try:
        entries = os.scandir(directory)
    except OSError:
        return beats  # not there yet (or not a directory: the supervisor refuses that before it starts)
    with entries:
        seen = 0
        for entry in entries:
            if BEAT_NAME.fullmatch(entry.name) is None:
                continue
            seen += 1
            if seen > MAX_BEAT_FILES:
                break
            path = Path(entry.path)
            try:
                record = parse_json(read_bytes(path, "heartbeat", "a heartbeat", follow_links=False), path,
                                    max_depth=4)
            except ZayaError as exc:
                if problems is not None:
                    problems[str(path)] = str(exc)
                continue
            if valid_beat(record):
                beats[record["rank"]] = record
            elif problems is not None:
                problems[str(path)] = f"{path}: not a heartbeat (a field missing, of the wrong type or out of range)"
    return beats


class HeartbeatWatcher:
    """Reads the ranks' heartbeats of one worker group and reports a hang."""

    def __init__(self, directory: Path, settings: HeartbeatSettings, started: float | None = None,
                 note: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.settings = settings
        self.started = time.time() if started is None else started
        self.note = note  # told once per file that is ignored
        self._noted: set[str] = set()

    def beats(self) -> dict[int, dict]:
        problems: dict[str, str] = {}
        beats = read_beats(self.directory, problems)
        for path, why in problems.items():
            if path not in self._noted and self.note is not None:
                self._noted.add(path)
                self.note(f"warning: heartbeat file ignored: {why}")
        return beats

    def progress(self) -> int:
        """The highest step any rank has reached (-1 before the first heartbeat)."""
        return max((beat["step"] for beat in self.beats().values()), default=-1)

    def finished(self, world: int) -> bool:
        beats = self.beats()
        return len(beats) >= world and all(beat["section"] == "done" for beat in beats.values())

    def poll(self, now: float | None = None) -> Finding | None:
        """A `hang` finding for the rank that stopped beating first, or None while every rank is on time."""
        now = time.time() if now is None else now
        beats = self.beats()
        if not beats:
            waited = now - self.started
            if waited > self.settings.init_timeout_s:
                return Finding("hang", "", f"no rank wrote a heartbeat within {waited:.1f} s of the start",
                               f"init timeout {self.settings.init_timeout_s:g} s")
            return None
        # The ranks step together, so a section's timeout comes from the longest duration any rank measured:
        # one rank's slightly shorter steps must not make it the first to look late.
        longest: dict[str, float] = {}
        for beat in beats.values():
            for section, seconds in beat.get("longest", {}).items():
                longest[section] = max(seconds, longest.get(section, 0.0))
        late, everyone = [], []
        for rank, beat in beats.items():
            timeout, why = self.settings.timeout(beat["section"], longest)
            item = (beat["time"], rank, beat, now - beat["time"], timeout, why)
            everyone.append(item)
            if item[3] > timeout:
                late.append(item)
        if not late:
            return None
        # The cause is a rank that cannot run (stopped, gone, stuck in the kernel), late or not yet, else the
        # first to stop beating: the others are waiting for it inside a collective.
        states = {rank: process_state(int(beat.get("pid", -1))) for _, rank, beat, *_ in everyone}
        stuck = [item for item in everyone if states[item[1]] not in ("R", "S")]
        _, rank, beat, age, timeout, why = min(stuck or late)
        state = states[rank]
        shown = {"T": "stopped (SIGSTOP or a debugger)", "Z": "a zombie", "D": "in uninterruptible I/O",
                 None: "gone"}.get(state, "running")
        others = sorted(r for _, r, *_ in everyone if r != rank)
        line = (f"rank {rank}: no heartbeat for {age:.1f} s in section '{beat['section']}' at step {beat['step']} "
                f"(timeout {timeout:.1f} s: {why}); process {beat.get('pid')} {shown}")
        detail = f"ranks {others} waiting behind it" if others else ""
        return Finding("hang", f"rank:{rank}", line, detail)
