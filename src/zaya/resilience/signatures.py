"""The failure signatures `zaya.resilience.diagnose` looks for, and the keyword dispatch that finds them fast.

A signature is a rule: the class of what it finds (a root class, or "cascade"), a regular expression for the
line, and (for a root) a function that turns the match into an explanation and a subject. The rules are kept
apart from the classifier because they are what grows: a new driver message or a new NCCL wording is one more
line in `_RULES`, next to the tables it looks codes up in (NVIDIA's Xid catalog, libibverbs' work-completion
statuses), while the classifier that picks roots and cascades stays as it is.

The order of `_RULES` is the priority: a line is the first rule's that matches it. Each rule names keywords,
whole words that every line it matches contains, so a line runs only the regular expressions of the rules
whose keywords it holds (`_triggered`); most log lines hold none and cost one scan.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# ---- code tables --------------------------------------------------------------------------------------

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



# ---- root signatures ----------------------------------------------------------------------------------

_PCI_DEV = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
_BDF = _PCI_DEV + r"\.[0-7]"
_BDF_RX = re.compile(r"\b(" + _BDF + r")\b")


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


# ---- the run's course --------------------------------------------------------------------------------

# What `zaya train` itself says of its course (zaya.train.stops, zaya.cli, zaya.launcher), which tells a run
# that ended well, or was stopped on purpose, from one that failed. Not roots of a failure: the classifier
# weighs them against the failures around them (zaya.resilience.diagnose).
START, PROGRESS, COMPLETED, STOPPED, STOP_SIGNAL = "start", "progress", "completed", "stopped", "stop_signal"
COURSE = (START, PROGRESS, COMPLETED, STOPPED, STOP_SIGNAL)
EXIT_STOPPED_EARLY = 75  # zaya.errors.EXIT_PREEMPTED: this module imports nothing of zaya's


def _signal_name(text: str) -> str:
    """`SIGINT` for "2", "SIGINT" or "Signals.SIGINT"; the text itself for anything else."""
    import signal

    name = text.rsplit(".", 1)[-1]
    if name.isdigit():
        try:
            return signal.Signals(int(name)).name
        except ValueError:
            return f"signal {name}"
    return name


def _by(sig: str) -> str:
    return f"{sig} (Ctrl-C)" if sig == "SIGINT" else sig


def _stopped(m: re.Match, body: str) -> _Hit:
    step, why = m.group("step"), m.group("why")
    if "nothing was trained yet" in body:
        return _Hit(f"the run stopped on {_by(why)} before its first step (exit code {EXIT_STOPPED_EARLY})")
    return _Hit(f"the run stopped at step {step} on {_by(why)} with a checkpoint of that step (exit code "
                f"{EXIT_STOPPED_EARLY}): the same command resumes it")


def _signalled(m: re.Match, body: str) -> _Hit:
    sig = _signal_name(m.group("sig"))
    return _Hit(f"the launcher got {_by(sig)} and passed it on to its workers (`zaya train` stops after its step "
                f"with a checkpoint when given the time: see its own lines; exit code {128 + _number(sig)})")


def _number(name: str) -> int:
    import signal

    return getattr(signal, name, signal.SIGTERM).value


_ABORTED = ("aborted by Ctrl-C (exit code 130): the steps since the last committed checkpoint are lost, and the "
            "same command resumes from it")

def _R(root: str, keywords: str, pattern: str, describe=None, *, lower: bool = False) -> _Rule:
    # `lower`: the pattern is written in lower case and searched in the lowercased line, which is cheaper
    # than re.IGNORECASE and keeps the literal-prefix search of the regex engine.
    return _Rule(root, tuple(keywords.split("|")), re.compile(pattern), describe, lower)


# In priority order: a line is the first rule's that matches it; the run's course (zaya's own lines) first, and
# every root rule before every cascade rule. Hardware before software (a CUDA error quoting an ECC failure is
# gpu_ecc, not oom or python), PCIe before NIC (a hot-plug "Link Down" is a slot).
_RULES: tuple[_Rule, ...] = (
    # the run's course
    _R(START, "training", r"^training on \S+ \(", _fixed("the run started")),  # the first line of every start
    _R(PROGRESS, "step", r"^step (?P<step>[\d,]+)/[\d,]+ \|", _fixed("step {step}")),
    _R(COMPLETED, "finished", r"^finished at step (?P<step>[\d,]+): the run is complete",
       _fixed("the run finished at step {step} (exit code 0)")),
    _R(COMPLETED, "done", r'^done: \{.*?"step": (?P<step>\d+)',
       _fixed("the run finished at step {step} (exit code 0)")),
    _R(STOPPED, "stopping", r"^stopping at step (?P<step>[\d,]+) on (?P<why>.+?)(?: \(train\.max_time_s = [^)]*\))?: "
       r"(?:checkpoint step [\d,]+ is committed|nothing was trained yet)", _stopped),
    _R(STOPPED, "stopped", r"^stopped at step (?P<step>[\d,]+) \((?P<why>[^)]*)\); exit code ", _stopped),
    _R(STOP_SIGNAL, "aborted", r"^zaya: aborted\b|^aborted by a second Ctrl-C\b", _fixed(_ABORTED)),
    _R(STOP_SIGNAL, "keyboardinterrupt", r"^KeyboardInterrupt\s*$", _fixed(_ABORTED)),
    _R(STOP_SIGNAL, "signalexception", r"SignalException: Process \d+ got signal: (?P<sig>[\w.]+)", _signalled),
    _R(STOP_SIGNAL, "death", r"Received (?P<sig>[\w.]+) death signal, shutting down workers", _signalled),
    _R(STOP_SIGNAL, "launch", r"^zaya launch: (?P<sig>SIG[A-Z0-9]+): passed on to the workers", _signalled),
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
    # a worker ended by the agent's SIGTERM (zaya's own exception for it, `zaya.owned.Terminated`): a consequence
    _R("cascade", "terminated", r"\bzaya\.owned\.Terminated\b"),
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


# ---- keyword dispatch ---------------------------------------------------------------------------------

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
