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
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from zaya.resilience.findings import Finding
from zaya.resilience.processes import process_state

SECTIONS = ("init", "checkpoint_load", "step", "eval", "checkpoint_save", "done")
WINDOW = 32  # recent durations kept per section


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
            self._tmp = self.directory / f".rank-{rank}.json.tmp"

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
        with open(self._tmp, "w", encoding="utf-8") as handle:
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
    """Whether `record` has every field of a heartbeat with a value of its type (a file in the directory that is
    not one of ours is ignored, never trusted)."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def seconds(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    return (isinstance(record, dict) and count(record.get("rank")) and count(record.get("pid"))
            and record["pid"] > 0 and isinstance(record.get("section"), str) and isinstance(record.get("step"), int)
            and seconds(record.get("time")) and isinstance(record.get("longest", {}), dict)
            and all(isinstance(k, str) and seconds(v) and v >= 0 for k, v in record.get("longest", {}).items()))


def read_beats(directory: Path) -> dict[int, dict]:
    """Every rank's latest heartbeat in `directory`, by rank (files being replaced are simply skipped)."""
    beats = {}
    if not directory.is_dir():
        return beats
    for path in directory.glob("rank-*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a torn read cannot happen (rename), but a file from a foreign writer might
        if valid_beat(record):
            beats[record["rank"]] = record
    return beats


class HeartbeatWatcher:
    """Reads the ranks' heartbeats of one worker group and reports a hang."""

    def __init__(self, directory: Path, settings: HeartbeatSettings, started: float | None = None):
        self.directory = Path(directory)
        self.settings = settings
        self.started = time.time() if started is None else started

    def beats(self) -> dict[int, dict]:
        return read_beats(self.directory)

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
