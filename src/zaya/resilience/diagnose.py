"""Attribute a training incident to its root cause, not to its loudest line.

When one GPU falls off the bus, every rank of the job logs an NCCL watchdog timeout, torchrun prints a
`ChildFailedError` for each worker and the survivors see their peers hang up. Those lines are the loudest and
the most numerous, and none of them is the cause. This module reads worker logs and kernel logs and names
the one line that is:

    gpu_xid   an NVIDIA `NVRM: Xid` report (its code is looked up in NVIDIA's Xid catalog)
    gpu_ecc   an uncorrectable memory or hardware error outside an Xid line (CUDA/HIP runtime, amdgpu RAS,
              machine checks, EDAC)
    gpu_hang  a GPU that stopped making progress (amdgpu ring timeouts, MES failures, GPU resets, ROCr
              hardware exceptions, a CUDA launch timeout)
    nic       an InfiniBand/RoCE completion error or async event, a failed verbs call, a link going down
    pcie      a PCIe AER error (corrected ones too; the detail names the severity), DPC, a hot-plug link down
    oom       device or host memory exhausted (allocators, the kernel's OOM killer)
    nan       a non-finite loss or gradient, or a loss scaler at its floor
    storage   an I/O error, a full or read-only or stale file system, a lost network file server
    python    an ordinary exception in user code: the exception line that ends a traceback, or `zaya: error`
    stopped   a stop on purpose, not a failure: the trainer's "stopping at step N on SIGTERM: checkpoint step
              N is committed" (a signal, Ctrl-C, train.max_time_s: resumable), or a signal from outside
              (Ctrl-C's KeyboardInterrupt and `zaya: aborted`, torchrun's `SignalException` and "death
              signal", `zaya launch`'s line)
    completed the run reached its end: the trainer's "finished at step N", or `zaya train`'s "done:" line
    unknown   nothing above was found (the cascade lines, if any, are still listed)

A run's own log (RUN/train.log, or what `zaya train` printed) tells its course, which a log of one incident does
not: every start ("training on ..."), its steps, and how it ended. The last end (completed, or stopped with a
checkpoint) is the diagnosis unless an attempt started after it or something failed after it: what failed
before it is history (a run that skipped a NaN step and went on to finish has finished). A log whose last
start has no end and no failure after it is `unknown`, said as such: still running, or killed without a word
(SIGKILL, the OOM killer).

Everything that merely follows from a failure elsewhere is a *cascade* line: NCCL/RCCL watchdog timeouts and
aborts, torchrun's failure summaries and signals, peers resetting connections, TCPStore and gloo errors,
`DistBackendError`, and a `RuntimeError` whose message is one of those. Cascade lines are collected, never
chosen as the root. A line is first searched for root signatures, so a root quoted inside a cascade line
(`watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered`) counts as
the root.

Which root wins when there are several: the earliest. Lines are ordered as given (the files in the order
given, each file top to bottom); when every candidate line carries a wall-clock timestamp of the same kind
(all with a UTC offset, or all local: syslog, journal, glog, `dmesg -T`, ISO without offset), they are
ordered by it instead, which is what orders lines from several files. Local stamps are compared by month,
day and time, so a year boundary between two files can misorder them. Kernel uptime stamps (`[ 12.345]`)
are not wall-clock time and are ignored. Two Xids report the aftermath of another error rather than a
fault of their own, 45 ("Preemptive cleanup, due to previous errors") and 154 ("GPU Recovery Action
Changed"): they are the root only when no other root line exists.

Lines are matched after their launcher and logger prefixes are removed (torchrun's `[rank1]:`/`[default0]:`,
glog's `[W1201 10:00:00.123 ...]`, kernel and journal stamps); the evidence stays the verbatim line. The rank
from a prefix is the finding's subject when the line names nothing better (a PCI address, a NIC, a path).

Speed: each line is lowercased and split into words once; only the rules whose keywords are among those
words run their regular expressions, so 100,000 lines take a fraction of a second. Odd content (binary
junk, endless lines) never raises: a file is read line by line, each line cut at 64 KiB (`zaya.reading`), only
the first 8192 characters of a line are matched, and an evidence or cascade line is kept cut to 500 characters
with a marker (`findings.clip`). A timestamp that does not parse or is out of the calendar's range (year 1 with
an offset, say) leaves its line untimed.

The signatures themselves (the rules, the Xid and IB status tables, the keyword dispatch) are in
`zaya.resilience.signatures`; this module is the classifier that applies them and its public API.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from zaya.reading import read_lines
from zaya.resilience.findings import Finding, clip
from zaya.resilience.signatures import (
    _RULES,
    _TRACEBACK,
    _ZAYA,
    COMPLETED,
    COURSE,
    IB_WC_STATUS,
    PROGRESS,
    SECONDARY_XIDS,
    START,
    STOP_SIGNAL,
    STOPPED,
    XID_MEANINGS,
    _Hit,
    _Rule,
    _triggered,
)

__all__ = [
    "IB_WC_STATUS",
    "MAX_CASCADE",
    "ROOT_CLASSES",
    "SECONDARY_XIDS",
    "XID_MEANINGS",
    "Diagnosis",
    "classify_files",
    "classify_lines",
    "classify_streams",
    "classify_text",
    "log_lines",
]

ROOT_CLASSES = ("gpu_xid", "gpu_ecc", "gpu_hang", "nic", "pcie", "oom", "nan", "storage", "python", "stopped",
                "completed", "unknown")

MAX_CASCADE = 20  # cascade lines kept verbatim; all of them are counted
_MAX_CANDIDATES_PER_SOURCE = 64  # the first root lines of each input; later ones cannot be the earliest there
_MATCH_CHARS = 8192
_TRACEBACK_LINES = 5000  # a traceback whose exception line never comes stops being one after this


@dataclass(frozen=True)
class Diagnosis:
    """The root cause of an incident, the line that shows it, and the lines that merely followed from it."""

    root: str  # one of ROOT_CLASSES
    line: str  # the evidence line, verbatim ("" for unknown)
    detail: str  # a human explanation, e.g. "Xid 79: GPU has fallen off the bus"
    cascade: list[str]  # cascade lines, verbatim, in input order (the first MAX_CASCADE)
    source: str = ""  # "file:lineno" of the evidence line when it came from a named input
    subject: str = ""  # what it concerns, in the vocabulary of `Finding.subject`
    cascade_total: int = 0  # how many cascade lines there were, including those not kept

    def to_dict(self) -> dict:
        """The diagnosis as a JSON-ready dict (`zaya diagnose --json`)."""
        return {"root": self.root, "line": self.line, "detail": self.detail, "cascade": list(self.cascade),
                "source": self.source, "subject": self.subject,
                "cascade_total": max(self.cascade_total, len(self.cascade))}

    def finding(self) -> Finding:
        """The diagnosis as the `Finding` the resilience policy matches on."""
        return Finding(signal=self.root, subject=self.subject, line=self.line, detail=self.detail)

    def one_line(self) -> str:
        """One human line: class, explanation, where, and the evidence."""
        where = f" at {self.source}" if self.source else ""
        return f"{self.root}: {self.detail}{where}: {self.line}" if self.line else f"{self.root}: {self.detail}"


# ---- line prefixes ------------------------------------------------------------------------------------

_MONTHS = {name: i for i, name in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1)}
_MONTH_RX = "|".join(_MONTHS)

# One prefix per match; a line can carry several (journal stamp, then kernel stamp; rank, then glog).
_PREFIX = re.compile(
    r"\[(?P<label>[A-Za-z_-]*)(?P<rank>\d+)\]: ?"  # torchrun: [rank1]: [default0]: [trainer3]:
    r"|\[?(?P<glog>[IWEF](?P<gmon>\d\d)(?P<gday>\d\d) (?P<gtime>\d\d:\d\d:\d\d(?:\.\d+)?))[^\]]*\] ?"  # glog
    r"|\[ *\d+\.\d+\] ?"  # kernel uptime: [ 1234.567890]
    r"|<\d>"  # raw dmesg priority
    r"|\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<tmon>" + _MONTH_RX + r") +(?P<tday>\d{1,2}) "
    r"(?P<ttime>\d\d:\d\d:\d\d) \d{4}\] ?"  # dmesg -T
    r"|(?P<smon>" + _MONTH_RX + r") +(?P<sday>\d{1,2}) (?P<stime>\d\d:\d\d:\d\d)(?:\.\d+)?"
    r"(?: [\w.-]+ [\w./@-]+?(?:\[\d+\])?:)? ?"  # syslog / journal: Dec 01 10:00:00 host kernel:
    r"|\[?(?P<iso>(?P<idate>\d{4}-\d\d-\d\d)[T ](?P<itime>\d\d:\d\d:\d\d(?:[.,]\d+)?)"
    r"(?P<itz>Z|[+-]\d\d:?\d\d)?)\]?(?: [\w.-]+ [\w./@-]+?(?:\[\d+\])?:)? ?"  # ISO (rsyslog, loggers)
)


def _strip_prefixes(line: str) -> tuple[str, int | None, str, tuple | None]:
    """(body, rank, label, stamp) of a line: the text after its prefixes, the rank a launcher prefix names,
    that prefix's label (the traceback-tracking key), and the raw wall-clock stamp if any."""
    pos, rank, label, stamp = 0, None, "", None
    for _ in range(6):
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        if m.group("rank") is not None:
            rank, label = int(m.group("rank")), m.group("label") + m.group("rank")
        elif m.group("glog"):
            stamp = ("local", int(m.group("gmon")), int(m.group("gday")), m.group("gtime"))
        elif m.group("tmon"):
            stamp = ("local", _MONTHS[m.group("tmon")], int(m.group("tday")), m.group("ttime"))
        elif m.group("smon"):
            stamp = ("local", _MONTHS[m.group("smon")], int(m.group("sday")), m.group("stime"))
        elif m.group("iso"):
            stamp = ("iso", m.group("idate"), m.group("itime"), m.group("itz"))
    return line[pos:], rank, label, stamp


def _stamp_key(stamp: tuple | None) -> tuple[str, object] | None:
    """A comparable (kind, key) for a raw stamp; None when there is none or it does not parse."""
    if stamp is None:
        return None
    try:
        if stamp[0] == "local":
            _, month, day, clock = stamp
            h, m, s = clock.split(":")
            return "local", (month, day, int(h) * 3600 + int(m) * 60 + float(s))
        _, date, clock, tz = stamp
        when = datetime.strptime(f"{date} {clock[:8]}", "%Y-%m-%d %H:%M:%S")
        if len(clock) > 9:
            when += timedelta(seconds=float("0." + clock[9:]))
        if not tz:
            return "local", (when.month, when.day, when.hour * 3600 + when.minute * 60 + when.second
                             + when.microsecond / 1e6)
        if tz != "Z":
            sign = 1 if tz[0] == "+" else -1
            digits = tz[1:].replace(":", "")
            when -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        return "utc", when
    except (ValueError, IndexError, OverflowError):  # not a date, or beyond year 1..9999 once shifted to UTC
        return None


# ---- classification -----------------------------------------------------------------------------------

_RANK_IN_LINE = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]|\(rank (\d+)\)")
_ZAYA_ERROR = re.compile(r"^zaya: error(?: \(rank (?P<rank>\d+)\))?: (?P<msg>.*)")
_IBSTAT_PORT = re.compile(r"^\s+Port (\d+):")
_FRAME = re.compile(r'^\s+File "[^"]*", line \d+')
_EXCEPTION_LINE = re.compile(r"^(?P<name>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::(?P<msg>.*))?$")
_EXCEPTION_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Iteration", "Failure", "Fault", "Warning")
# A run's log (zaya.train.log) ends a run that a bug ended with the exception's own line, without its traceback
# (the command prints that): such a line is a root there, in a log whose lines carry the run log's stamp or after
# a run's start line.
_BUG_SUFFIXES = ("Error", "Exception", "Failure", "Fault")
_RUN_LOG_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


@dataclass(frozen=True)
class _Candidate:
    order: int
    root: str
    line: str
    detail: str
    subject: str
    source: str
    stamp: tuple | None
    secondary: bool
    stop: bool = False  # a stop from outside (a signal, Ctrl-C), not a failure


class _Classifier:
    """Reads lines, one input after another, keeping root candidates, cascade lines and the run's course: where
    its last attempt started, the last step it logged, and how its last end was (completed, stopped)."""

    def __init__(self):
        self.order = 0
        self.candidates: list[_Candidate] = []
        self.cascade: list[str] = []
        self.cascade_total = 0
        self.start: _Candidate | None = None  # the last start line
        self.end: _Candidate | None = None  # the last line of a run that completed or stopped with a checkpoint
        self.step = ""  # the last step line's step

    def feed(self, lines: Iterable[str], source: str = "") -> None:
        """Classify every line of one input; `source` names it in the evidence's "file:lineno"."""
        tracebacks: dict[str, int] = {}  # launcher prefix -> line number of its open traceback's header
        frames: set[str] = set()  # launcher prefixes in the frames of a traceback whose header was cut off
        adapter = ""  # ibstat: "CA 'mlx5_0'" and "Port 1:" name the adapter the next "State:" line is about
        kept = {False: 0, True: 0}  # root candidates kept from this input: primary, secondary (Xid 45, 154)
        for lineno, raw in enumerate(lines, start=1):
            self.order += 1
            if isinstance(raw, bytes):
                raw = raw.decode("utf-8", errors="replace")
            line = raw.rstrip("\r\n")
            head = line[:_MATCH_CHARS]
            # Most lines carry no keyword and no traceback is open: they cost one scan.
            triggered = _triggered(head.lower())
            run_bug = any(word in head for word in _BUG_SUFFIXES) and \
                (self.start is not None or _RUN_LOG_STAMP.match(head) is not None)
            if not (triggered or tracebacks or frames or adapter or run_bug) and 'File "' not in head \
                    and not head.startswith("CA '"):
                continue
            body, rank, label, stamp = _strip_prefixes(head)
            if not body.strip():
                continue
            exception = None
            if body[0] in " \t":
                # In a traceback, a frame or its source is code, not an event. A frame outside one is a
                # traceback whose header was cut off (a log's tail often starts mid-way): its end still counts.
                if label in tracebacks:
                    continue
                if label in frames or _FRAME.match(body):
                    frames.add(label)
                    continue
            elif label in tracebacks or label in frames:
                frames.discard(label)
                exception = _exception_line(body)
                if label in tracebacks and (exception is not None or lineno - tracebacks[label] > _TRACEBACK_LINES):
                    del tracebacks[label]
            if body.startswith("CA '"):
                adapter = body[4:].split("'", 1)[0]
            elif adapter and (port := _IBSTAT_PORT.match(body)) is not None:
                adapter = adapter.split("/", 1)[0] + "/" + port.group(1)

            rule, hit = self._match(triggered, body)
            if rule is not None and (rule.root == "cascade" or hit.cascade):
                self._add_cascade(line)
                continue
            where = f"{source}:{lineno}" if source else ""
            if rule is not None and rule.root in COURSE and rule.root != STOP_SIGNAL:
                self._course(_Candidate(self.order, rule.root, clip(line), clip(hit.detail), "", where, stamp, False))
                if rule.root in (COMPLETED, STOPPED):
                    kept = {False: 0, True: 0}
                continue
            candidate = None
            if rule is not None:
                subject = hit.subject
                if not subject and adapter and "State:" in body:
                    subject = f"ib:{adapter}"
                candidate = (rule.root, hit.detail, subject or _rank_subject(rank, body), hit.secondary)
                if rule.root == STOP_SIGNAL:
                    candidate = (STOPPED, hit.detail, candidate[2], False)
            elif exception is not None:
                name, message = exception
                detail = f"uncaught {name}" + (f": {message}" if message else "")
                candidate = ("python", detail, _rank_subject(rank, body), False)
            elif run_bug and body[0] not in " \t" and (bug := _exception_line(body)) is not None \
                    and bug[0].endswith(_BUG_SUFFIXES):
                detail = f"the run ended on an uncaught {bug[0]}" + (f": {bug[1]}" if bug[1] else "")
                candidate = ("python", detail, _rank_subject(rank, body), False)
            elif _ZAYA in triggered and (m := _ZAYA_ERROR.match(body)) is not None:
                subject = f"rank:{m.group('rank')}" if m.group("rank") else _rank_subject(rank, body)
                candidate = ("python", f"zaya stopped with an error: {m.group('msg')}", subject, False)
            elif _TRACEBACK in triggered and "Traceback (most recent call last)" in body:
                tracebacks[label] = lineno
            if candidate is not None:
                root, detail, subject, secondary = candidate
                # Only the first root lines of an input can be its earliest; a secondary Xid matters only
                # when nothing else is found, so its first one is enough.
                if kept[secondary] < (1 if secondary else _MAX_CANDIDATES_PER_SOURCE):
                    kept[secondary] += 1
                    self.candidates.append(_Candidate(self.order, root, clip(line), clip(detail), clip(subject),
                                                      where, stamp, secondary, rule is not None and root == STOPPED))

    def _course(self, mark: _Candidate) -> None:
        """A line of the run's course. A run's end (completed, stopped with a checkpoint) is what its log says
        unless something fails after it: the roots before it are history, forgotten."""
        if mark.root == START:
            self.start, self.step = mark, ""
        elif mark.root == PROGRESS:
            self.step = mark.detail.removeprefix("step ")
        else:
            self.end, self.candidates = mark, []

    @staticmethod
    def _match(triggered: tuple[int, ...], body: str) -> tuple[_Rule | None, _Hit | None]:
        """The first triggered rule that matches the line, and what it makes of it."""
        low = None
        for index in triggered:
            if index < 0:
                break
            rule = _RULES[index]
            if rule.lower and low is None:
                low = body.lower()
            m = rule.regex.search(low if rule.lower else body)
            if m is None:
                continue
            if rule.describe is None:
                return rule, None
            hit = rule.describe(m, body)
            if hit is not None:
                return rule, hit
        return None, None

    def _add_cascade(self, line: str) -> None:
        self.cascade_total += 1
        if len(self.cascade) < MAX_CASCADE:
            self.cascade.append(clip(line))

    def result(self) -> Diagnosis:
        """The diagnosis of everything fed so far."""
        cascade = list(self.cascade)
        end, start = self.end, self.start
        # the run's last end stands if no attempt started after it and nothing failed since (a stop signal after
        # it is the launcher's echo of the one it stopped on)
        if end is not None and (start is None or start.order < end.order) and \
                all(c.stop for c in self.candidates):
            return Diagnosis(end.root, end.line, end.detail, cascade, end.source, "", self.cascade_total)
        candidates = [c for c in self.candidates if not c.secondary] or self.candidates
        if not candidates:
            if self.cascade_total:
                detail = (f"only consequences of a failure elsewhere ({self.cascade_total} cascade line(s)); the "
                          "cause is in another log: another rank's, or the kernel log")
            elif start is not None:
                at = f" at {start.source}" if start.source else ""
                steps = f"; its last step logged is {self.step}" if self.step else "; no step logged"
                detail = (f"the run's last start{at} has no end line and no known failure after it{steps}: it is "
                          "still running, or was ended from outside without a word (SIGKILL, the kernel's OOM "
                          "killer: see the kernel log)")
            else:
                detail = "no known failure signature in the logs"
            return Diagnosis("unknown", "", detail, cascade, cascade_total=self.cascade_total)
        keys = [_stamp_key(c.stamp) for c in candidates]
        kinds = {key[0] if key else None for key in keys}
        if len(kinds) == 1 and None not in kinds:
            best = min(zip(keys, candidates, strict=True), key=lambda pair: (pair[0][1], pair[1].order))[1]
        else:
            best = min(candidates, key=lambda c: c.order)
        return Diagnosis(best.root, best.line, best.detail, cascade, best.source, best.subject, self.cascade_total)


def _exception_line(body: str) -> tuple[str, str] | None:
    """(name, message) when `body` is the line that ends a traceback: `ValueError: bad`, `AssertionError`,
    `torch.OutOfMemoryError: ...`."""
    m = _EXCEPTION_LINE.match(body.rstrip())
    if m is None:
        return None
    name = m.group("name")
    if "." not in name and not name.endswith(_EXCEPTION_SUFFIXES):
        return None
    return name.rsplit(".", 1)[-1], (m.group("msg") or "").strip()


def _rank_subject(rank: int | None, body: str) -> str:
    if rank is not None:
        return f"rank:{rank}"
    m = _RANK_IN_LINE.search(body)
    return f"rank:{m.group(1) or m.group(2)}" if m else ""


# ---- public API ---------------------------------------------------------------------------------------


def classify_lines(lines: Iterable[str], source: str = "") -> Diagnosis:
    """Diagnose one log given as lines (with or without their newlines); `source` names it in the evidence's
    "file:lineno"."""
    classifier = _Classifier()
    classifier.feed(lines, source)
    return classifier.result()


def classify_text(text: str) -> Diagnosis:
    """Diagnose one log given as a string, split into lines as a file is read (LF, CRLF, a lone CR)."""
    return classify_lines(io.StringIO(text, newline=None))


def classify_streams(streams: Iterable[tuple[str, Iterable[str]]]) -> Diagnosis:
    """Diagnose several logs of one incident, each a (name, lines) pair, read in the order given."""
    classifier = _Classifier()
    for name, lines in streams:
        classifier.feed(lines, name)
    return classifier.result()


def classify_files(paths: Sequence[Path]) -> Diagnosis:
    """Diagnose the log files of one incident (worker logs, a saved dmesg), read in the order given.

    Undecodable bytes are replaced, not refused; a file that cannot be read raises `ZayaError`."""
    return classify_streams((str(path), log_lines(Path(path))) for path in paths)


def log_lines(path: Path) -> Iterator[str]:
    """The lines of a log file, read lazily, each cut at 64 KiB, undecodable bytes replaced; `ZayaError` if it is not
    a regular file (a FIFO would block, a device never end) or cannot be read."""
    return read_lines(path, "a log")
