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
    unknown   nothing above was found (the cascade lines, if any, are still listed)

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
junk, endless lines) never raises: only the first 8192 characters of a line are matched.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding

ROOT_CLASSES = ("gpu_xid", "gpu_ecc", "gpu_hang", "nic", "pcie", "oom", "nan", "storage", "python", "unknown")

MAX_CASCADE = 20  # cascade lines kept verbatim; all of them are counted
_MAX_CANDIDATES_PER_SOURCE = 64  # the first root lines of each input; later ones cannot be the earliest there
_MATCH_CHARS = 8192
_TRACEBACK_LINES = 5000  # a traceback whose exception line never comes stops being one after this

# NVIDIA's Xid catalog ("Xid Errors", docs.nvidia.com/deploy/xid-errors), the short description of each code
# a training node meets; codes outside the table are reported by number.
XID_MEANINGS = {
    8: "GPU stopped processing",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    44: "Graphics Engine fault during context switch",
    45: "Preemptive cleanup, due to previous errors",
    46: "GPU stopped processing",
    48: "Double Bit ECC Error",
    54: "Auxiliary power is not connected to the GPU board",
    56: "Display Engine error",
    57: "Error programming video memory interface",
    58: "Unstable video memory interface detected",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    69: "Graphics Engine class error",
    73: "NVENC2 Error",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    80: "Corrupted data sent to GPU",
    81: "VGA Subsystem Error",
    92: "High single-bit ECC error rate",
    93: "Non-fatal violation of provisioned InfoROM wear limit",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    110: "Security Fault Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
    121: "C2C Link Error",
    122: "SPI PMU RPC Read Failure",
    123: "SPI PMU RPC Write Failure",
    124: "SPI PMU RPC Erase Failure",
    125: "Inforom FS Failure",
    140: "Unrecovered ECC Error",
    143: "GPU Initialization Failure",
    154: "GPU Recovery Action Changed",
}

# Xids that the driver logs because of another error (45 follows an aborted or killed process, 154 a fault
# that changed the GPU's recovery action); alone they are still the best evidence there is.
SECONDARY_XIDS = frozenset({45, 154})

# `ibv_wc_status_str` of libibverbs, for the status in NCCL's "Got completion from peer ... with status=N".
IB_WC_STATUS = {
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "Work Request Flushed Error",
    7: "bad response error",
    8: "local access error",
    9: "remote invalid request error",
    10: "remote access error",
    11: "remote operation error",
    12: "transport retry counter exceeded",
    13: "RNR retry counter exceeded",
    16: "aborted error",
    19: "fatal error",
    20: "response timeout error",
    21: "general error",
}
# A flushed work request means its queue pair had already failed: the completion that failed it is the news.
_IB_FLUSHED = 5

# `ibv_event_type_str` events that report no fault (a port coming up, a subnet manager's bookkeeping).
_BENIGN_IB_EVENTS = frozenset({
    "port active", "communication established", "send queue drained", "path migrated", "lid change",
    "p_key change", "pkey change", "sm change", "srq limit reached", "last wqe reached", "client reregistration",
    "gid table change",
})


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
    except (ValueError, IndexError):
        return None


# ---- root signatures ----------------------------------------------------------------------------------

_PCI_DEV = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
_BDF = _PCI_DEV + r"\.[0-7]"
_BDF_RX = re.compile(r"\b(" + _BDF + r")\b")
_RANK_IN_LINE = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]|\(rank (\d+)\)")


@dataclass(frozen=True)
class _Hit:
    detail: str
    subject: str = ""
    secondary: bool = False  # a root only when no other root line exists (Xid 45, 154)
    cascade: bool = False  # looked like a root signature but reports a consequence (a flushed IB request)


@dataclass(frozen=True)
class _Rule:
    root: str  # a root class, or "cascade"
    keywords: tuple[str, ...]  # words (see _SEPARATORS); every line `regex` matches contains one of them
    regex: re.Pattern
    describe: Callable[[re.Match, str], _Hit | None] | None  # None from it: not this rule after all
    lower: bool  # `regex` is searched in the lowercased line


def _fixed(detail: str, subject: Callable[[re.Match, str], str] | None = None):
    # A describe function for a rule whose explanation is a template over its named groups.
    return lambda m, body: _Hit(detail.format(**{k: v or "?" for k, v in m.groupdict().items()}),
                                subject(m, body) if subject else "")


def _gpu_pci(address: str | None) -> str:
    # A GPU is named as the Xid line names it, domain:bus:device, so Xid, ECC and hang lines of one GPU agree.
    return f"pci:{address.lower()[:10]}" if address else ""


def _bdf_subject(m: re.Match, body: str) -> str:
    found = _BDF_RX.search(body)
    return _gpu_pci(found.group(1)) if found else ""


def _xid(m: re.Match, body: str) -> _Hit:
    code = int(m.group("code"))
    meaning = XID_MEANINGS.get(code, "a code outside the built-in table (see NVIDIA's Xid catalog)")
    return _Hit(f"Xid {code}: {meaning}", _gpu_pci(m.group("pci")), secondary=code in SECONDARY_XIDS)


def _fallen_off(m: re.Match, body: str) -> _Hit:
    return _Hit(f"Xid 79: {XID_MEANINGS[79]}", _gpu_pci(m.group("pci")))


def _aer(m: re.Match, body: str) -> _Hit:
    severity = m.group("sev")
    source = m.group("src")
    multiple = "multiple " if m.group("multi") else ""
    where = f" from {source}" if source and ":" in source else ""
    subject = f"pci:{source.lower()}" if source and ":" in source else _pcie_subject(body)
    return _Hit(f"PCIe AER: {multiple}{severity} error{where}", subject)


def _pcie_bus_error(m: re.Match, body: str) -> _Hit:
    return _Hit(f"PCIe AER: severity={m.group('sev').strip()}, type={m.group('type').strip()}", _pcie_subject(body))


def _pcie_subject(body: str) -> str:
    # A PCIe error names a function (a NIC's two ports differ), so its subject keeps the full address.
    found = _BDF_RX.search(body)
    return f"pci:{found.group(1).lower()}" if found else ""


def _ib_completion(m: re.Match, body: str) -> _Hit:
    status = int(m.group("status"))
    meaning = IB_WC_STATUS.get(status, "unknown status")
    hca = re.search(r"\bhca (\S+)", body)
    detail = f"IB completion error: status {status} ({meaning}) from peer {m.group('peer')}"
    if hca:
        detail += f" on {hca.group(1)}"
    return _Hit(detail, f"ib:{hca.group(1)}" if hca else "", cascade=status == _IB_FLUSHED)


def _ib_async(m: re.Match, body: str) -> _Hit | None:
    event = m.group("event").strip().rstrip(".")
    if event.lower() in _BENIGN_IB_EVENTS:
        return None
    dev, port = m.group("dev"), m.group("port")
    subject = f"ib:{dev}/{port}" if dev and port else (f"ib:{dev}" if dev else "")
    return _Hit(f"IB async event: {event}", subject)


def _ib_verbs(m: re.Match, body: str) -> _Hit:
    return _Hit(f"IB verbs call ibv_{m.group('verb')} failed", "")


def _ifname(m: re.Match, body: str) -> str:
    return f"nic:{m.group('ifname')}"


def _rdma_link(m: re.Match, body: str) -> _Hit:
    return _Hit(f"RDMA link {m.group('dev')} is down", f"ib:{m.group('dev')}")


def _oom_device(m: re.Match, body: str) -> _Hit:
    size = re.search(r"Tried to allocate ([\d.]+ ?[KMGTP]?i?B)", body)
    gpu = re.search(r"\bGPU (\d+)\b", body)
    detail = "device out of memory" + (f" (tried to allocate {size.group(1)})" if size else "")
    return _Hit(detail, f"gpu:{gpu.group(1)}" if gpu else "")


def _oom_killed(m: re.Match, body: str) -> _Hit:
    return _Hit(f"host out of memory: the kernel killed process {m.group('pid')} ({m.group('name')})")


def _oom_kill_record(m: re.Match, body: str) -> _Hit:
    task = re.search(r"\btask=([^,\s]+),pid=(\d+)", body)
    detail = "host out of memory: the kernel's OOM killer ran"
    return _Hit(f"{detail} (killed {task.group(1)}, pid {task.group(2)})" if task else detail)


def _loss_scale(m: re.Match, body: str) -> _Hit | None:
    # Overflow skips are routine for fp16 until the scale stops being able to shrink: at 1 or below it is
    # not compensating for overflow any more, every step is non-finite.
    try:
        scale = float(m.group("scale"))
    except ValueError:
        return None
    return _Hit(f"the loss scaler is at its floor (scale {m.group('scale')}): every step overflows") \
        if scale <= 1.0 else None


def _errno(m: re.Match, body: str) -> _Hit:
    path = m.group("path")
    return _Hit(f"{m.group('msg')} (errno {m.group('errno')})", f"path:{path}" if path else "")


def _storage_message(m: re.Match, body: str) -> _Hit:
    path = re.search(r"'(/[^']*)'", body)
    return _Hit(m.group(0), f"path:{path.group(1)}" if path else "")


_ERRNO_NAMES = {"EIO": "input/output error", "ENOSPC": "no space left on device", "ESTALE": "stale file handle",
                "EDQUOT": "disk quota exceeded", "EROFS": "read-only file system"}


def _R(root: str, keywords: str, pattern: str, describe=None, *, lower: bool = False) -> _Rule:
    # `lower`: the pattern is written in lower case and searched in the lowercased line, which is cheaper
    # than re.IGNORECASE and keeps the literal-prefix search of the regex engine.
    return _Rule(root, tuple(keywords.split("|")), re.compile(pattern), describe, lower)


# In priority order: a line is the first rule's that matches it, and every root rule comes before every
# cascade rule. Hardware before software (a CUDA error quoting an ECC failure is gpu_ecc, not oom or
# python), PCIe before NIC (a hot-plug "Link Down" is a slot).
_RULES: tuple[_Rule, ...] = (
    # gpu_xid: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    # (the address may carry a function and, on MIG, " GPU-I:nn GPU-CI:nn"; old drivers omit "PCI:")
    _R("gpu_xid", "xid", r"NVRM: Xid \((?:PCI:)?(?P<pci>" + _PCI_DEV + r")[^)]*\):\s*(?P<code>\d+)", _xid),
    _R("gpu_xid", "fallen",
       r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>" + _PCI_DEV + r")(?:\.\d)?:?(?: GPU)? has fallen off the bus",
       _fallen_off),
    # gpu_ecc
    _R("gpu_ecc", "uncorrectable", r"uncorrectable ECC error encountered",
       _fixed("uncorrectable ECC error in device memory (reported by the CUDA/HIP runtime)")),
    _R("gpu_ecc", "hiperroreccnotcorrectable|cudaerroreccuncorrectable",
       r"\b(?:hipErrorECCNotCorrectable|cudaErrorECCUncorrectable)\b",
       _fixed("uncorrectable ECC error in device memory (reported by the CUDA/HIP runtime)")),
    _R("gpu_ecc", "uncorrectable", r"uncorrectable nvlink error",
       _fixed("uncorrectable NVLink error (reported by the CUDA runtime)"), lower=True),
    _R("gpu_ecc", "uncorrectable", r"(?P<n>\d+) uncorrectable hardware errors? detected in (?P<block>\S+) block",
       _fixed("amdgpu RAS: {n} uncorrectable hardware error(s) in the {block} block", _bdf_subject)),
    _R("gpu_ecc", "ras", r"amdgpu\b.*\bras\b.*\buncorrect",
       _fixed("amdgpu RAS: uncorrectable error", _bdf_subject), lower=True),
    _R("gpu_ecc", "poison|poisoned|poisoning",
       r"poison(?:ed)? (?:consumption|consumed)|consum\w* poison|\bras poison|amdgpu\b.*\bpoison",
       _fixed("poisoned memory was consumed (an uncorrectable error reached a reader)", _bdf_subject), lower=True),
    _R("gpu_ecc", "hardware", r"\[hardware error\].*\b(?:uncorrect\w*|fatal)\b",
       _fixed("uncorrected hardware error (machine check / firmware-first report)"), lower=True),
    _R("gpu_ecc", "uncorrected", r"uncorrected hardware memory error",
       _fixed("uncorrected host memory error (machine check)"), lower=True),
    _R("gpu_ecc", "edac", r"EDAC\b.*\bUE\b", _fixed("uncorrectable host memory error (EDAC)")),
    # gpu_hang
    _R("gpu_hang", "timeout", r"\bring (?P<ring>\S+) timeout\b",
       _fixed("amdgpu ring {ring} timeout: the GPU stopped making progress", _bdf_subject)),
    _R("gpu_hang", "timedout", r"amdgpu_job_timedout\b",
       _fixed("amdgpu job timeout: the GPU stopped making progress", _bdf_subject)),
    _R("gpu_hang", "mes", r"MES failed to respon\w*|failed to remove hardware queue from MES",
       _fixed("the amdgpu MES scheduler stopped responding", _bdf_subject)),
    _R("gpu_hang", "reset|recovery", r"amdgpu\b.*\bGPU (?:reset|recovery)\b",
       _fixed("amdgpu reset the GPU (it had hung)", _bdf_subject)),
    _R("gpu_hang", "hang", r"GPU Hang\b", _fixed("ROCr: GPU hang")),
    _R("gpu_hang", "hsa", r"HSA_STATUS_ERROR_EXCEPTION\b(?:.*?\bcode: (?P<code>0x[0-9a-fA-F]+))?",
       lambda m, body: _Hit("ROCr: hardware exception (HSA_STATUS_ERROR_EXCEPTION"
                            + (f", code {m.group('code')})" if m.group("code") else ")"))),
    _R("gpu_hang", "hsa", r"HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION\b",
       _fixed("ROCr: memory aperture violation (HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION)")),
    _R("gpu_hang", "launch|cudaerrorlaunchtimeout|hiperrorlaunchtimeout",
       r"the launch timed out and was terminated|\b(?:cudaErrorLaunchTimeout|hipErrorLaunchTimeOut)\b",
       _fixed("a GPU kernel launch timed out and was terminated")),
    # pcie
    _R("pcie", "aer",
       r"AER: (?P<multi>Multiple )?(?P<sev>Uncorrect(?:ed|able) \((?:Non-)?Fatal\)|Correct(?:ed|able)) error"
       r"(?: message)? received(?::| from)?\s*(?:id=)?(?P<src>" + _BDF + r"|[0-9a-fA-F]{4}\b)?", _aer),
    _R("pcie", "pcie", r"PCIe Bus Error: severity=(?P<sev>[^,]+), type=(?P<type>[^,]+)",
       _pcie_bus_error),
    _R("pcie", "dpc", r"DPC: containment event",
       lambda m, body: _Hit("PCIe downstream port containment: the link was taken down after an "
                            "uncorrectable error", _pcie_subject(body))),
    _R("pcie", "pciehp", r"pciehp: Slot\((?P<slot>[^)]*)\): Link Down",
       lambda m, body: _Hit(f"PCIe hot-plug: slot {m.group('slot')} link down", _pcie_subject(body))),
    # nic: NCCL/RCCL NET/IB, verbs, kernel link events, rdma/ibstat/ibv_devinfo output
    _R("nic", "completion",
       r"Got completion from peer (?P<peer>\S+?),? with (?:error|status)[ =](?P<status>\d+)", _ib_completion),
    _R("nic", "ib",
       r"NET/IB\s*:\s*(?:(?P<dev>[\w.-]+):(?P<port>\d+) )?(?:Got async (?:error )?event"
       r"|async fatal event(?: on \w+(?: \([^)]*\))?)?)\s*:\s*(?P<event>.+)", _ib_async),
    _R("nic", "retry", r"transport retry counter exceeded",
       _fixed("IB transport retry counter exceeded (the peer's port stopped answering)")),
    _R("nic", "ibv", r"(?:Call to |NET/IB\s*:.*?)ibv_(?P<verb>\w+?)(?:\(\))? (?:failed|error|returned)", _ib_verbs),
    _R("nic", "module", r"Port module event(?:\[error\])?: module (?P<module>\d+), (?P<what>Cable [^,]+)",
       _fixed("NIC port module event: {what} (module {module})", _bdf_subject)),
    _R("nic", "down", r"(?P<ifname>[A-Za-z][\w.@-]*): (?:NIC )?[Ll]ink (?:is )?[Dd]own\b",
       _fixed("network link down on {ifname}", _ifname)),
    _R("nic", "down", r"link status definitely down for interface (?P<ifname>[\w.@-]+?),?(?:\s|$)",
       _fixed("bonding: link down on {ifname}", _ifname)),
    _R("nic", "down", r"^link (?P<dev>\S+) state DOWN\b", _rdma_link),
    _R("nic", "down", r"^\s*State:\s*Down\b", _fixed("IB port state Down (ibstat)")),
    _R("nic", "down", r"\bstate:\s*PORT_DOWN\b|\bLINK_DOWN\b", _fixed("IB port down")),
    # oom
    _R("oom", "outofmemoryerror|memory", r"OutOfMemoryError\b|\b(?:CUDA|HIP) out of memory\b", _oom_device),
    _R("oom", "memory|hiperroroutofmemory|cudaerrormemoryallocation",
       r"(?:cuda|hip) (?:error|failure)(?: \d+)?:? '?out of memory|hiperroroutofmemory|cudaerrormemoryallocation",
       _oom_device, lower=True),
    _R("oom", "defaultcpuallocator", r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)",
       _fixed("host out of memory (the CPU allocator failed)")),
    _R("oom", "memory",
       r"(?:Memory cgroup )?[Oo]ut of memory: Kill(?:ed)? process (?P<pid>\d+) \((?P<name>[^)]*)\)", _oom_killed),
    _R("oom", "oom", r"oom-kill:|invoked oom-killer\b", _oom_kill_record),
    _R("oom", "memoryerror", r"^MemoryError\b", _fixed("host out of memory (Python MemoryError)")),
    _R("oom", "alloc", r"std::bad_alloc\b", _fixed("host allocation failed (std::bad_alloc)")),
    # nan ("nan" is a whole word here: nanoseconds, nanoGPT and maintenance are not)
    _R("nan", "nan|inf|infinity", r"\bloss\s*(?:is|=|:|became|of)\s*(?P<v>nan|[+-]?inf(?:inity)?)\b",
       _fixed("non-finite loss ({v})"), lower=True),
    _R("nan", "nan|infinity", r'"loss":\s*(?P<v>nan|-?infinity)\b', _fixed("non-finite loss ({v})"), lower=True),
    _R("nan", "finite", r"non-finite (?:loss|grad\w*)", _fixed("non-finite loss or gradient"), lower=True),
    _R("nan", "nan|inf|infinity", r"grad(?:ient)?[ _]norm\s*(?:is|=|:)\s*(?P<v>nan|[+-]?inf(?:inity)?)\b",
       _fixed("non-finite gradient norm ({v})"), lower=True),
    _R("nan", "nan|inf|nans|infs", r"found (?:nan|inf)s? in (?:the )?(?:local )?(?:grad\w*|loss)|\b(?:nan|inf)s? "
       r"(?:detected|found) in (?:the )?(?:loss|grad\w*)", _fixed("non-finite values in the loss or gradients"),
       lower=True),
    _R("nan", "minimum", r"loss scale already at minimum",
       _fixed("the loss scaler is at its floor: every step overflows"), lower=True),
    _R("nan", "reducing", r"loss scaler?\b.*?\breducing (?:loss scale )?to (?P<scale>[\d.]+(?:e[+-]?\d+)?)",
       _loss_scale, lower=True),
    _R("nan", "floatingpointerror", r"FloatingPointError\b", _fixed("FloatingPointError: a non-finite value")),
    _R("nan", "nan", r"Function '(?P<fn>\w+)' returned nan values in its (?P<index>\d+)\w* output",
       _fixed("autograd anomaly detection: {fn} produced NaN")),
    # storage
    _R("storage", "errno",
       r"\[Errno (?P<errno>5|28|30|116|122)\] (?P<msg>[^:'\"]*[^:'\" ])(?::\s*'(?P<path>[^']*)')?", _errno),
    _R("storage", "space|output|stale|quota|read",
       r"No space left on device|Input/output error|Stale (?:NFS )?file handle|Disk quota exceeded"
       r"|Read-only file system", _storage_message),
    _R("storage", "eio|enospc|estale|edquot|erofs", r"\b(?P<name>EIO|ENOSPC|ESTALE|EDQUOT|EROFS)\b",
       lambda m, body: _Hit(f"{_ERRNO_NAMES[m.group('name')]} ({m.group('name')})")),
    _R("storage", "dev", r"I/O error(?:,| on) dev (?P<dev>[\w-]+)", _fixed("block I/O error on {dev}")),
    _R("storage", "ext", r"EXT4-fs error\b|EXT4-fs \([\w-]+\): Remounting filesystem read-only",
       _fixed("ext4 file system error")),
    _R("storage", "xfs", r"XFS \((?P<dev>[\w-]+)\): .*(?:I/O error|Corruption|[Ff]ilesystem has been shut down"
       r"|[Ss]hutting down filesystem)", _fixed("XFS file system error on {dev}")),
    _R("storage", "nfs", r"nfs: server (?P<server>\S+) not responding",
       _fixed("NFS server {server} not responding")),
    _R("storage", "lustre|lustreerror", r"Lustre(?:Error)?:.*\bevicted\b", _fixed("the Lustre client was evicted")),
    _R("storage", "btrfs", r"BTRFS (?:error|critical)\b", _fixed("btrfs file system error")),
    _R("storage", "nvme", r"nvme\d+: I/O \d+ .*\btimeout\b", _fixed("NVMe I/O timeout")),
    # cascade: consequences of a failure elsewhere, never the root. NCCL/RCCL watchdog and aborts:
    _R("cascade", "watchdog", r"Watchdog caught collective operation timeout|watchdog (?:got stuck|thread terminated)"
       r"|Process group watchdog|detected by watchdog"),
    _R("cascade", "aborted|ncclcommabort", r"[Cc]ommunicator was aborted|ncclCommAbort\b|Fatal Python error: Aborted"),
    _R("cascade", "operations", r"Some NCCL operations have failed or timed out"),
    _R("cascade", "entire", r"taking the entire process down"),
    _R("cascade", "ncclremoteerror|remote",
       r"ncclRemoteError\b|remote process exited or there was a network error"),
    _R("cascade", "heartbeat", r"Heartbeat monitor timed out"),
    _R("cascade", "timeout", r"Timeout at NCCL work"),
    _R("cascade", "dump", r"ProcessGroupNCCL preparing to dump|Received a dump signal"),
    _R("cascade", "service", r"\[Proxy Service \d+\] Failed"),
    # torchrun's failure summary and signals
    _R("cascade", "childfailederror", r"ChildFailedError\b"),
    _R("cascade", "exitcode", r"^\s*exitcode\s*:\s*-?\d+ \(pid: \d+\)|failed \(exitcode: -?\d+\) local_rank: \d+"),
    _R("cascade", "signal", r"^\s*traceback\s*:\s*Signal \d+|Signal \d+ \(SIG[A-Z]+\) received"
       r"|Sending process \d+ closing signal SIG"),
    # peers hanging up, TCPStore, gloo, rendezvous
    _R("cascade", "connection", r"Connection (?:reset|closed) by (?:remote )?peer|Connection refused"),
    _R("cascade", "pipe", r"Broken pipe\b"),
    _R("cascade", "gloo", r"gloo.*(?:Read error|Timed out waiting|Connection closed)"),
    _R("cascade", "timed", r"Timed out waiting \d+ms for (?:recv|send) operation"),
    _R("cascade", "distbackenderror|distnetworkerror|diststoreerror", r"Dist(?:Network|Backend|Store)Error\b"),
    _R("cascade", "recv|sendbytes|recvbytes", r"Failed to recv, got 0 bytes|(?:send|recv)Bytes failed"),
    _R("cascade", "tcpstore", r"TCPStore\b.*(?:fail|error|reset|timed? ?out)"),
    _R("cascade", "socket", r"socket has (?:failed|timed out)"),
    _R("cascade", "rendezvouserror|rendezvousclosederror|rendezvoustimeouterror|rendezvousconnectionerror"
       "|rendezvousstateerror|rendezvousgracefulexiterror",
       r"Rendezvous(?:Closed|Timeout|Connection|State|GracefulExit)?Error\b"),
)

_ZAYA_ERROR = re.compile(r"^zaya: error(?: \(rank (?P<rank>\d+)\))?: (?P<msg>.*)")
_IBSTAT_PORT = re.compile(r"^\s+Port (\d+):")
_FRAME = re.compile(r'^\s+File "[^"]*", line \d+')
_EXCEPTION_LINE = re.compile(r"^(?P<name>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::(?P<msg>.*))?$")
_EXCEPTION_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Iteration", "Failure", "Fault", "Warning")


_TRACEBACK = -1  # dispatch entries after the rules: a traceback header, a zaya error line
_ZAYA = -2

# Keywords are whole words of the lowercased line, where anything but an ASCII letter separates words
# ("torch.OutOfMemoryError:" is the word "outofmemoryerror", "oom-kill:" the words "oom" and "kill").
_SEPARATORS = str.maketrans({chr(code): " " for code in range(128) if not chr(code).isalpha()})


def _build_dispatch() -> tuple[frozenset[str], dict[str, tuple[int, ...]]]:
    """All keywords, and for each the rules it can trigger, in priority order, then the special checks."""
    owners: dict[str, set[int]] = {}
    for index, rule in enumerate(_RULES):
        for keyword in rule.keywords:
            owners.setdefault(keyword, set()).add(index)
    owners.setdefault("traceback", set()).add(_TRACEBACK)
    owners.setdefault("zaya", set()).add(_ZAYA)
    return frozenset(owners), {word: _ordered(indices) for word, indices in owners.items()}


def _ordered(indices: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(indices, key=lambda i: (i < 0, i)))


_KEYWORDS, _DISPATCH = _build_dispatch()


def _triggered(low: str) -> tuple[int, ...]:
    """The rules (then the special checks) that the keywords in the lowercased line `low` point to."""
    words = low.translate(_SEPARATORS).split()
    if _KEYWORDS.isdisjoint(words):
        return ()
    found = _KEYWORDS.intersection(words)
    if len(found) == 1:
        return _DISPATCH[next(iter(found))]
    return _ordered({i for word in found for i in _DISPATCH[word]})


# ---- classification -----------------------------------------------------------------------------------


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


class _Classifier:
    """Reads lines, one input after another, keeping root candidates and cascade lines."""

    def __init__(self):
        self.order = 0
        self.candidates: list[_Candidate] = []
        self.cascade: list[str] = []
        self.cascade_total = 0

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
            if not (triggered or tracebacks or frames or adapter) and 'File "' not in head \
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
            candidate = None
            if rule is not None:
                subject = hit.subject
                if not subject and adapter and "State:" in body:
                    subject = f"ib:{adapter}"
                candidate = (rule.root, hit.detail, subject or _rank_subject(rank, body), hit.secondary)
            elif exception is not None:
                name, message = exception
                detail = f"uncaught {name}" + (f": {message}" if message else "")
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
                    self.candidates.append(_Candidate(self.order, root, line, detail, subject,
                                                      f"{source}:{lineno}" if source else "", stamp, secondary))

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
            self.cascade.append(line)

    def result(self) -> Diagnosis:
        """The diagnosis of everything fed so far."""
        cascade = list(self.cascade)
        candidates = [c for c in self.candidates if not c.secondary] or self.candidates
        if not candidates:
            detail = (f"only consequences of a failure elsewhere ({self.cascade_total} cascade line(s)); the cause "
                      "is in another log: another rank's, or the kernel log" if self.cascade_total
                      else "no known failure signature in the logs")
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
    """The lines of a log file, read lazily, undecodable bytes replaced; `ZayaError` if it cannot be read."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            yield from handle
    except OSError as exc:
        raise ZayaError(f"{path}: cannot read log: {(exc.strerror or str(exc)).lower()}") from None
