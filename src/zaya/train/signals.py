"""The trainer's answers to its own training signals (`zaya.resilience.signals`), as the policy decides:

    non-finite gradient norm   skip_step: drop the update, count the step   | rollback | anything else: stop
    loss spike                 rollback: to the newest checkpoint before it, its data skipped for good | log | stop
    straggler                  reported
    expert collapse            log: a warning line and an incident | stop

Every decision is one incident record, written by rank 0 (all ranks decide alike: the signals are global). The
roll-back itself, a restore of the model and data, is the trainer's: `watch` asks for it.
"""

from __future__ import annotations

from collections.abc import Callable

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding
from zaya.resilience.incidents import IncidentLog
from zaya.resilience.policy import Policy
from zaya.resilience.signals import CollapseWatch, SpikeDetector, straggler


class TrainingSignals:
    """What the signals remember between steps, and the decisions on them (see the module docstring)."""

    def __init__(self, policy: Policy, incidents: IncidentLog, *, attempt: int, is_main: bool,
                 say: Callable[[str], None]):
        self.policy, self.incidents, self.attempt, self.is_main, self.say = policy, incidents, attempt, is_main, say
        self.spikes = SpikeDetector(policy.training)
        self.collapse = CollapseWatch(policy.training)
        self.windows: list[tuple[int, int]] = []  # consumed samples before and after each recent step
        self._skipped_in_row = 0  # non-finite steps in a row
        self._pending_rollback: Finding | None = None  # a non-finite step the policy rolls back
        self._straggler: str | None = None  # the subject of the rank reported as straggling
        # steps this process has watched: its first is its warm-up (the data's first reads, state built on first
        # use, after a start or a resume), whose host time says nothing about a slow rank
        self._watched = 0

    def record(self, finding: Finding, action: str, outcome: str, step: int, quiet: bool = False) -> None:
        """Record a decision (rank 0: every rank takes the same one) and say it in the log (unless `quiet`: said
        already)."""
        if not quiet:
            self.say(f"incident: {finding.line} -> {action}: {outcome}")
        if self.is_main:
            self.incidents.append({"source": "trainer", "signal": finding.signal, "subject": finding.subject,
                                   "evidence": [finding.line], "detail": finding.detail, "action": action,
                                   "outcome": outcome, "step": step, "attempt": self.attempt})

    def note_window(self, before: int, after: int) -> None:
        """The consumed samples before and after a step: the data a roll-back would skip."""
        keep = self.policy.training.spike_skip_steps
        self.windows = [*self.windows, (before, after)][-keep:] if keep else []

    def window(self) -> tuple[int, int]:
        """The samples of the recent steps, [start, stop), that a roll-back skips."""
        return (self.windows[0][0], self.windows[-1][1]) if self.windows else (0, 0)

    def nonfinite(self, step: int, norm: float, untrained: bool = False) -> bool:
        """Decide on a non-finite gradient norm at `step`: True to drop the update (skip_step, rollback). With
        `untrained` weights (as initialised or loaded, no update applied yet) there is nothing to skip back to: the
        next batch meets the same weights, so the run stops at once."""
        finding = Finding("nan", f"step:{step}", f"step {step}: non-finite gradient norm ({norm}); loss or "
                          "gradients are NaN or inf")
        if untrained:
            outcome = ("stopping: no update was applied yet, so there is nothing to skip back to (the initial weights, "
                       "model.initializer_range or the data?); no checkpoint written")
            self.record(finding, "stop", outcome, step, quiet=True)
            raise ZayaError(f"{finding.line}; {outcome}")
        action = self.policy.decide(finding).action
        if action not in ("skip_step", "rollback"):
            raise ZayaError(f"{finding.line}; stopping (policy: {action}; last checkpoint kept)")
        self._skipped_in_row += 1
        limit = self.policy.training.max_skipped_steps
        if self._skipped_in_row > limit:
            raise ZayaError(f"{finding.line}; {self._skipped_in_row} non-finite steps in a row (more than "
                            f"training.max_skipped_steps = {limit}); stopping, last checkpoint kept")
        if action == "skip_step":
            self.record(finding, action, "update dropped, step counted", step)
        else:
            self._pending_rollback = finding
        return True

    def updated(self) -> None:
        """A step's update was applied: the non-finite steps in a row are over."""
        self._skipped_in_row = 0

    @property
    def skipped_in_row(self) -> int:
        """The non-finite steps in a row up to now (0 after a step whose update was applied)."""
        return self._skipped_in_row

    def watch(self, step: int, row: dict) -> Finding | None:
        """The step's signals: spikes, stragglers, a roll-back the non-finite check asked for. Returns the finding
        the run must roll back for, if any."""
        finding, self._pending_rollback = self._pending_rollback, None
        if finding is None and not row["skipped"]:
            finding = self.spikes.check(step, row["loss"])
        slow = straggler(step, row["host_time"], self.policy.training) if self._watched else None
        self._watched += 1
        if slow is not None and slow.subject != self._straggler:
            # once when a rank starts to straggle, not at every step it goes on straggling
            self.record(slow, self.policy.decide(slow).action, "reported", step)
        self._straggler = slow.subject if slow is not None else None
        collapse = self.collapse.check(step, row["expert_load"]) if not row["skipped"] else None
        if collapse is not None:
            action = self.policy.decide(collapse).action
            if action == "stop":
                self.record(collapse, action, "stopping; last checkpoint kept", step)
                raise ZayaError(f"{collapse.line}; stopping (policy), last checkpoint kept")
            self.say(f"warning: {collapse.line}; {collapse.detail}")
            self.record(collapse, action, "warned", step, quiet=True)
        if finding is None:
            return None
        action = self.policy.decide(finding).action if finding.signal == "loss_spike" else "rollback"
        if action == "stop":
            self.record(finding, action, "stopping; last checkpoint kept", step)
            raise ZayaError(f"{finding.line}; stopping (policy), last checkpoint kept")
        if action != "rollback":
            self.record(finding, action, "recorded", step)
            return None
        return finding
