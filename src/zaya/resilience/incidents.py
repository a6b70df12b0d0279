"""`incidents.jsonl`: every decision the supervisor or the trainer takes, one JSON line each, appended.

A record: `time` (ISO, UTC), `event` ("incident", or "recovered" when the run gets past the step it failed
at), `signal`, `subject`, `evidence` (the lines that show it), `detail`, `action`, `outcome`, `step`,
`attempt`, and `source` ("supervisor" or "trainer"). Lines are small and written with one `write` on a file
opened for appending, so the supervisor and the trainer can share the file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from zaya.errors import ZayaError


def now_iso(seconds: float | None = None) -> str:
    seconds = time.time() if seconds is None else seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z"


class IncidentLog:
    """Appends records to one `incidents.jsonl`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict) -> dict:
        record = {"time": now_iso(), "event": "incident", **record}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return record


def read_incidents(path: Path) -> list[dict]:
    """The records of an `incidents.jsonl`; a torn last line (a writer killed mid-write) is left out."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read incidents: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number != len(text.splitlines()):
                raise ZayaError(f"{path}:{number}: not a JSON line") from None
    return records


def timeline(records: list[dict]) -> str:
    """The incidents as a table a person reads: time, signal and subject, action, outcome, evidence."""
    if not records:
        return "no incidents"
    lines = []
    for record in records:
        if record.get("event") == "recovered":
            lines.append(f"{record['time']}  recovered: {record.get('outcome', '')}")
            continue
        who = record.get("signal", "?") + (f" {record['subject']}" if record.get("subject") else "")
        evidence = (record.get("evidence") or [""])[0]
        lines.append(f"{record['time']}  {who:<22} -> {record.get('action', '?'):<12} {record.get('outcome', '')}"
                     + (f"\n{'':26}{evidence[:160]}" if evidence else ""))
    return "\n".join(lines)
