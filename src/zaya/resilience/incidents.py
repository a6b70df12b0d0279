"""`incidents.jsonl`: every decision the supervisor or the trainer takes, one JSON line each, appended.

A record: `time` (ISO, UTC), `event` ("incident", or "recovered" when the run gets past the step it failed
at), `signal`, `subject`, `evidence` (the lines that show it), `detail`, `action`, `outcome`, `step`,
`attempt`, and `source` ("supervisor" or "trainer"). Lines are small and written with one `write` on a file
opened for appending, so the supervisor and the trainer can share the file.

Every string of a record is cut to 500 characters with a marker (`findings.clip`): an evidence line may be a
worker's line of megabytes. The file is appended to only if it is a regular file (opened without following a
link and without blocking: a FIFO planted there is refused, never written through). A reader (`zaya report`)
takes it line by line, each line cut at 64 KiB and the whole at 64 MiB, and checks every record's fields: a
field of the wrong type is one line naming the file, the line and the field.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import MiB, bounded_lines, open_regular, os_reason, parse_json, size_text
from zaya.resilience.findings import clip
from zaya.resilience.statedir import check_file, open_append
from zaya.schema import Fields

INCIDENTS_CAP = 64 * MiB  # an incidents file a report reads: a long run's records are a few hundred bytes each
_TEXT_FIELDS = ("time", "event", "signal", "subject", "detail", "action", "outcome", "source", "node")


def now_iso(seconds: float | None = None) -> str:
    seconds = time.time() if seconds is None else seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z"


def _clipped(value):
    if isinstance(value, str):
        return clip(value)
    if isinstance(value, list):
        return [_clipped(item) for item in value]
    return value


def check_incidents_file(path: Path) -> None:
    """Refuse an incidents path that holds anything but a regular file (a link, a FIFO, a directory): it is
    appended to, never written through."""
    check_file(path, "the incidents file")


class IncidentLog:
    """Appends records to one `incidents.jsonl`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict) -> dict:
        record = {"time": now_iso(), "event": "incident", **{k: _clipped(v) for k, v in record.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(record) + "\n").encode()
        fd = open_append(self.path, "the incidents file")  # never through a link, never blocking on a FIFO
        try:
            os.write(fd, data)  # one write: a reader never sees half a record
            os.fsync(fd)
        finally:
            os.close(fd)
        return record


def read_incidents(path: Path) -> list[dict]:
    """The records of an `incidents.jsonl`; a torn last line (a writer killed mid-write) is left out. A file that is
    not a regular file, larger than `INCIDENTS_CAP`, or with a record of the wrong shape is one `ZayaError`."""
    records, broken, total = [], None, 0
    with open_regular(path, "an incidents file") as handle:
        try:
            for number, line in enumerate(bounded_lines(handle), 1):
                total += len(line) + 1
                if total > INCIDENTS_CAP:
                    raise ZayaError(f"{path}: larger than {size_text(INCIDENTS_CAP)}, the limit for an incidents "
                                    "file")
                if broken is not None:
                    raise broken  # a broken line with more after it: not a torn end
                if not line.strip():
                    continue
                try:
                    data = parse_json(line, f"{path}:{number}", max_depth=8)
                except ZayaError:
                    broken = ZayaError(f"{path}:{number}: not a JSON line")
                    continue
                records.append(_checked(data, f"{path}:{number}"))
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read ({os_reason(exc)})") from None
    return records


def _checked(data, source: str) -> dict:
    """One record, its fields of the types a timeline and a report take (other fields are left as they are)."""
    doc = Fields(data, source)
    doc.str("time")
    for name in _TEXT_FIELDS[1:]:
        doc.str(name, default=None)
    doc.list("evidence", default=None, of=str, max_len=1000)
    doc.int("step", default=None)
    doc.int("attempt", default=None)
    doc.float("seconds", default=None)
    return data


def timeline(records: list[dict]) -> str:
    """The incidents as a table a person reads: time, signal and subject, action, outcome, evidence."""
    if not records:
        return "no incidents"
    lines = []
    for record in records:
        if record.get("event") == "recovered":
            lines.append(f"{record.get('time', '?')}  recovered: {record.get('outcome', '')}")
            continue
        who = (record.get("signal") or "?") + (f" {record['subject']}" if record.get("subject") else "")
        evidence = (record.get("evidence") or [""])[0]
        lines.append(f"{record.get('time', '?')}  {who:<22} -> {record.get('action') or '?':<12} "
                     f"{record.get('outcome') or ''}" + (f"\n{'':26}{evidence[:160]}" if evidence else ""))
    return "\n".join(lines)
