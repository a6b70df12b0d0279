"""The supervisor's policy: a TOML file of settings and rules; the first rule that matches a finding decides.

    [supervisor]                  poll_s, max_no_progress (K), max_restarts, kill_grace_s, stop_grace_s, kernel_log
    [heartbeat]                   factor, floor_s, first_timeout_s, init_timeout_s (zaya.resilience.heartbeat)
    [training]                    what the trainer watches itself: spike_ratio, spike_window, spike_min_history,
                                  spike_skip_steps, max_skipped_steps, straggler_ratio, straggler_min_s,
                                  collapse_ratio, collapse_steps
    [probes]                      root, gpu, nics, storage, ... (zaya.resilience.probe_config.ProbeConfig)

    [[rule]]
    signal = "nic_flap"           a signal name, a list of them, or "*"
    subject = "nic:*"             optional glob on the finding's subject
    min_count = 3                 optional: the finding's count must reach it
    action = "cordon_node"

Actions: `restart` (kill the group, start it again), `cordon_gpu` / `cordon_node` (restart without that GPU or
this node), `skip_step` (the trainer drops the step's update), `rollback` (the trainer goes back to the last
checkpoint and skips the data window), `stop` (end the run, exit code 4), `log` (record it, do nothing).
The built-in rules (`DEFAULT_RULES`) follow a file's own rules, so a file only says what it changes.

The file is read as any config is (`zaya.reading.read_toml`: a regular file, at most 4 MiB, nested at most 64
deep), and every number must be finite and within its range (`BOUNDS`): a poll interval of 0 would busy-wait,
and a timeout of 1e300 overflows the OS's timers. A mistake is one line naming the file, the key and the range.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import read_toml
from zaya.resilience.findings import Finding
from zaya.resilience.heartbeat import HeartbeatSettings
from zaya.resilience.probe_config import ProbeConfig
from zaya.schema import Fields, shown

ACTIONS = ("restart", "cordon_gpu", "cordon_node", "skip_step", "rollback", "stop", "log")
TRAINING_ACTIONS = ("skip_step", "rollback")  # decided inside the trainer, for its own signals
TRAINING_SIGNALS = ("nan", "loss_spike", "straggler", "expert_collapse")
SIGNALS = (
    # root classes of `zaya diagnose`
    "gpu_xid", "gpu_ecc", "gpu_hang", "nic", "pcie", "oom", "nan", "storage", "python", "stopped", "completed",
    "unknown",
    # the watchers' own
    "hang", "gpu_lost", "nic_flap", "disk_low", "loss_spike", "straggler", "expert_collapse",
)


MAX_SECONDS = 10_000_000  # any timeout or grace period: about 116 days, within every OS timer and clock
MAX_COUNT = 1_000_000
# the range of every number of a policy file, by its key
BOUNDS: dict[str, tuple[float, float]] = {
    "supervisor.poll_s": (0.01, 3600),
    "supervisor.max_no_progress": (1, MAX_COUNT),
    "supervisor.max_restarts": (0, MAX_COUNT),
    "supervisor.kill_grace_s": (0, MAX_SECONDS),
    "supervisor.stop_grace_s": (0, MAX_SECONDS),
    "heartbeat.factor": (1, 1000),
    "heartbeat.floor_s": (0, MAX_SECONDS),
    "heartbeat.first_timeout_s": (0, MAX_SECONDS),
    "heartbeat.init_timeout_s": (0, MAX_SECONDS),
    "training.spike_ratio": (1, MAX_COUNT),
    "training.spike_window": (1, 100_000),  # the median of this many losses is taken every step
    "training.spike_min_history": (0, 100_000),
    "training.spike_skip_steps": (0, MAX_COUNT),
    "training.max_skipped_steps": (0, MAX_COUNT),
    "training.straggler_ratio": (1, MAX_COUNT),
    "training.straggler_min_s": (0, MAX_SECONDS),
    "training.collapse_ratio": (1, MAX_COUNT),
    "training.collapse_steps": (1, MAX_COUNT),
}
MAX_RULES = 1024
MAX_ARGS = 64  # supervisor.kernel_log: a command and its arguments
MAX_TEXT = 4096  # one string: a command's argument, a rule's subject


@dataclass
class SupervisorSettings:
    poll_s: float = 1.0
    max_no_progress: int = 3  # K: restarts in a row that get no further than the one before
    max_restarts: int = 100
    kill_grace_s: float = 10.0  # after a failure: SIGTERM first, SIGKILL after this
    # when the supervisor itself is stopped (SIGTERM, SIGINT): the time the trainers get to finish their step and
    # write a checkpoint before SIGKILL
    stop_grace_s: float = 120.0
    # a command whose output is the kernel log (e.g. ["dmesg", "--time-format", "iso"]); what it adds while
    # a run lasts is classified with the run's own log; [] reads no kernel log
    kernel_log: list[str] = field(default_factory=list)


@dataclass
class TrainingSettings:
    """Thresholds of the signals the trainer watches itself."""

    spike_ratio: float = 1.5  # loss > ratio x median of the recent window
    spike_window: int = 20
    spike_min_history: int = 10  # finite losses seen before spikes are judged
    spike_skip_steps: int = 1  # the data of this many steps, ending with the spike, is never trained on
    max_skipped_steps: int = 10  # non-finite steps in a row before the trainer gives up
    straggler_ratio: float = 1.5  # a rank's local time > ratio x the median rank's ...
    straggler_min_s: float = 0.05  # ... and by at least this much
    # a MoE layer's busiest expert above this many times the mean expert load (at most the number of experts:
    # a layer whose every token goes to one expert) ...
    collapse_ratio: float = 3.0
    # ... in the load averaged over this many steps (judged from the step this many steps after the start on):
    # one step's load swings from expert to expert while the biases and the routers settle
    collapse_steps: int = 20


@dataclass(frozen=True)
class Rule:
    signals: tuple[str, ...]  # ("*",) matches every signal
    action: str
    subject: str = "*"
    min_count: int = 1

    def matches(self, finding: Finding) -> bool:
        return ((self.signals == ("*",) or finding.signal in self.signals)
                and fnmatch.fnmatchcase(finding.subject, self.subject) and finding.count >= self.min_count)

    def describe(self) -> str:
        extra = (f" subject={self.subject}" if self.subject != "*" else "") + \
                (f" min_count={self.min_count}" if self.min_count > 1 else "")
        return f"{'|'.join(self.signals)}{extra} -> {self.action}"


DEFAULT_RULES = (
    Rule(("gpu_ecc", "gpu_lost"), "cordon_gpu", subject="gpu:*"),
    Rule(("nic",), "cordon_node"),
    Rule(("nic_flap",), "cordon_node", min_count=5),
    Rule(("nic_flap", "disk_low", "straggler", "expert_collapse"), "log"),
    Rule(("nan",), "skip_step"),
    Rule(("loss_spike",), "rollback"),
    Rule(("storage",), "stop"),  # a full or failing disk needs a person; restarting would only repeat it
    Rule(("*",), "restart"),
)


@dataclass
class Policy:
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    heartbeat: HeartbeatSettings = field(default_factory=HeartbeatSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    rules: tuple[Rule, ...] = ()
    source: str = "built-in policy"

    def decide(self, finding: Finding) -> Rule:
        """The first rule (the file's, then the built-in ones) that matches `finding`."""
        for rule in (*self.rules, *DEFAULT_RULES):
            if rule.matches(finding):
                return rule
        raise AssertionError("the built-in rules end with a catch-all")

    @classmethod
    def load(cls, path: str | Path | None) -> Policy:
        """Read a policy file (None: the built-in policy); any mistake is one line naming the file and key."""
        if path is None:
            return cls()
        path = Path(path)
        data = read_toml(path, "config", "a policy file")
        where = str(path)
        known = {"supervisor", "heartbeat", "training", "probes", "rule"}
        for key in data:
            if key not in known:
                raise ZayaError(f"{where}: unknown table '{key}' (known: {', '.join(sorted(known))})")
        policy = cls(
            supervisor=_settings(SupervisorSettings, data.get("supervisor", {}), "supervisor", where),
            heartbeat=_settings(HeartbeatSettings, data.get("heartbeat", {}), "heartbeat", where),
            training=_settings(TrainingSettings, data.get("training", {}), "training", where),
            probes=ProbeConfig.from_dict(_table(data.get("probes", {}), "probes", where), where),
            rules=tuple(_rule(item, index, where) for index, item in enumerate(_rules(data.get("rule", []), where))),
            source=where,
        )
        return policy


def _table(value: object, name: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise ZayaError(f"{where}: '{name}' must be a table")
    return value


def _rules(value: object, where: str) -> list:
    if not isinstance(value, list) or len(value) > MAX_RULES:
        raise ZayaError(f"{where}: 'rule' must be an array of tables ([[rule]]), at most {MAX_RULES:,} of them")
    return value


def _settings(kind, values: object, name: str, where: str):
    table = Fields(_table(values, name, where), where, name)
    known = [f.name for f in dataclasses.fields(kind)]
    defaults = kind()
    out = {}
    for key in table.data:
        if key not in known:
            raise ZayaError(f"{where}: unknown key '{name}.{key}' (known: {', '.join(known)})")
        default = getattr(defaults, key)
        if isinstance(default, list):  # a command: strings
            out[key] = list(table.list(key, of=str, max_len=MAX_ARGS))
            if any(len(arg) > MAX_TEXT for arg in out[key]) or (out[key] and not out[key][0]):
                raise ZayaError(f"{where}: field '{name}.{key}' must be a command: non-empty strings of at most "
                                f"{MAX_TEXT:,} characters")
            continue
        lo, hi = BOUNDS[f"{name}.{key}"]
        out[key] = table.float(key, lo=lo, hi=hi) if isinstance(default, float) else table.int(key, lo=lo, hi=hi)
    return kind(**out)


def _rule(item: object, index: int, where: str) -> Rule:
    name = f"rule[{index}]"
    item = _table(item, name, where)
    for key in item:
        if key not in ("signal", "subject", "min_count", "action"):
            raise ZayaError(f"{where}: unknown key '{name}.{key}' (known: signal, subject, min_count, action)")
    if "signal" not in item or "action" not in item:
        raise ZayaError(f"{where}: '{name}' needs both 'signal' and 'action'")
    signals = item["signal"] if isinstance(item["signal"], list) else [item["signal"]]
    for signal in signals:
        if not isinstance(signal, str) or (signal != "*" and signal not in SIGNALS):
            raise ZayaError(f"{where}: '{name}.signal': unknown signal {shown(signal)} (known: {', '.join(SIGNALS)}, "
                            "*)")
    action = item["action"]
    if not isinstance(action, str) or action not in ACTIONS:
        raise ZayaError(f"{where}: '{name}.action': unknown action {shown(action)} (known: {', '.join(ACTIONS)})")
    if action in TRAINING_ACTIONS and not set(signals) <= {"nan", "loss_spike"}:
        raise ZayaError(f"{where}: '{name}.action': '{action}' is taken by the trainer, for the signals nan and "
                        "loss_spike only")
    subject, min_count = item.get("subject", "*"), item.get("min_count", 1)
    if not isinstance(subject, str) or len(subject) > MAX_TEXT:
        raise ZayaError(f"{where}: '{name}.subject' must be a string (a glob such as \"gpu:*\") of at most "
                        f"{MAX_TEXT:,} characters")
    if not isinstance(min_count, int) or isinstance(min_count, bool) or not 1 <= min_count <= MAX_COUNT:
        raise ZayaError(f"{where}: '{name}.min_count' must be a positive integer (at most {MAX_COUNT:,}), got "
                        f"{shown(min_count)}")
    return Rule(tuple(signals), action, subject, min_count)
