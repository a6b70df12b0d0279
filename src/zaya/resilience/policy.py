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
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding
from zaya.resilience.heartbeat import HeartbeatSettings
from zaya.resilience.probe_config import ProbeConfig

ACTIONS = ("restart", "cordon_gpu", "cordon_node", "skip_step", "rollback", "stop", "log")
TRAINING_ACTIONS = ("skip_step", "rollback")  # decided inside the trainer, for its own signals
TRAINING_SIGNALS = ("nan", "loss_spike", "straggler", "expert_collapse")
SIGNALS = (
    # root classes of `zaya diagnose`
    "gpu_xid", "gpu_ecc", "gpu_hang", "nic", "pcie", "oom", "nan", "storage", "python", "unknown",
    # the watchers' own
    "hang", "gpu_lost", "nic_flap", "disk_low", "loss_spike", "straggler", "expert_collapse",
)


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
    collapse_steps: int = 20  # ... in this many steps in a row (early in a real run; a short trial is left alone)


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
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ZayaError(f"{path}: cannot read the policy file: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ZayaError(f"{path}: not valid TOML: {exc}") from None
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
        if policy.supervisor.max_no_progress < 1:
            raise ZayaError(f"{where}: 'supervisor.max_no_progress' must be at least 1")
        if policy.training.collapse_steps < 1 or not policy.training.collapse_ratio >= 1:
            raise ZayaError(f"{where}: 'training.collapse_steps' and 'training.collapse_ratio' must be at least 1")
        return policy


def _table(value: object, name: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise ZayaError(f"{where}: '{name}' must be a table")
    return value


def _rules(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise ZayaError(f"{where}: 'rule' must be an array of tables ([[rule]])")
    return value


def _settings(kind, values: object, name: str, where: str):
    values = _table(values, name, where)
    fields = {f.name: f for f in dataclasses.fields(kind)}
    out = {}
    for key, value in values.items():
        if key not in fields:
            raise ZayaError(f"{where}: unknown key '{name}.{key}' (known: {', '.join(fields)})")
        default = getattr(kind(), key)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ZayaError(f"{where}: '{name}.{key}' must be {type(default).__name__}, got {value!r}")
        if isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise ZayaError(f"{where}: '{name}.{key}' must be a list of strings, got {value!r}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ZayaError(f"{where}: '{name}.{key}' must be a finite number, got {value!r}")
        elif value < 0:
            raise ZayaError(f"{where}: '{name}.{key}' must not be negative, got {value!r}")
        out[key] = value
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
            raise ZayaError(f"{where}: '{name}.signal': unknown signal {signal!r} (known: {', '.join(SIGNALS)}, *)")
    action = item["action"]
    if action not in ACTIONS:
        raise ZayaError(f"{where}: '{name}.action': unknown action {action!r} (known: {', '.join(ACTIONS)})")
    if action in TRAINING_ACTIONS and not set(signals) <= {"nan", "loss_spike"}:
        raise ZayaError(f"{where}: '{name}.action': '{action}' is taken by the trainer, for the signals nan and "
                        "loss_spike only")
    subject, min_count = item.get("subject", "*"), item.get("min_count", 1)
    if not isinstance(subject, str):
        raise ZayaError(f"{where}: '{name}.subject' must be a string (a glob such as \"gpu:*\")")
    if not isinstance(min_count, int) or isinstance(min_count, bool) or min_count < 1:
        raise ZayaError(f"{where}: '{name}.min_count' must be a positive integer, got {min_count!r}")
    return Rule(tuple(signals), action, subject, min_count)
