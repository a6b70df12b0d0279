"""The trainer's answers to its own training signals (`zaya.resilience.signals`), as the policy decides:

    non-finite gradient norm   skip_step: drop the update, count the step   | rollback | anything else: stop
    loss spike                 rollback: to the newest checkpoint before it, its data skipped for good | log | stop
    straggler                  reported

Part of `Trainer` (a mixin: it works on the trainer's model, loader, manager and state), kept apart so the
training loop stays short. Every decision is one incident record, written by rank 0 (all ranks decide alike:
the signals are global).
"""

from __future__ import annotations

import os

from zaya.errors import ZayaError
from zaya.model.flops import training_flops_per_token
from zaya.resilience.faults import RUN_ENV
from zaya.resilience.findings import Finding
from zaya.resilience.incidents import IncidentLog
from zaya.resilience.policy import Policy
from zaya.resilience.signals import SpikeDetector, straggler
from zaya.train import checkpoint as ckpt


class TrainingSignals:
    """The trainer's non-finite, spike and straggler handling."""

    def _init_signals(self) -> None:
        """The policy (the supervisor's, or the built-in one) and what the signals remember between steps."""
        self.policy = Policy.from_env()
        self.incidents = IncidentLog.for_trainer(self.run_dir)
        self.spikes = SpikeDetector(self.policy.training)
        self._windows: list[tuple[int, int]] = []  # consumed samples before and after each recent step
        self._skipped_in_row = 0  # non-finite steps in a row
        self._pending_rollback: Finding | None = None  # a non-finite step the policy rolls back
        self._straggler: str | None = None  # the subject of the rank reported as straggling

    def _incident(self, finding: Finding, action: str, outcome: str) -> None:
        """Record a decision (rank 0: every rank takes the same one) and say it in the log."""
        self._say(f"incident: {finding.line} -> {action}: {outcome}")
        if self.launch.is_main:
            self.incidents.append({"source": "trainer", "signal": finding.signal, "subject": finding.subject,
                                   "evidence": [finding.line], "detail": finding.detail, "action": action,
                                   "outcome": outcome, "step": self.state.step,
                                   "attempt": int(os.environ.get(RUN_ENV, "0") or 0)})

    def _skip_nonfinite(self, step: int, norm: float) -> bool:
        """Decide on a non-finite gradient norm at `step`: True to drop the update (skip_step, rollback)."""
        finding = Finding("nan", f"step:{step}", f"step {step}: non-finite gradient norm ({norm}); loss or "
                          "gradients are NaN or inf")
        action = self.policy.decide(finding).action
        if action not in ("skip_step", "rollback"):
            raise ZayaError(f"{finding.line}; stopping (policy: {action}; last checkpoint kept)")
        self._skipped_in_row += 1
        limit = self.policy.training.max_skipped_steps
        if self._skipped_in_row > limit:
            raise ZayaError(f"{finding.line}; {self._skipped_in_row} non-finite steps in a row (more than "
                            f"training.max_skipped_steps = {limit}); stopping, last checkpoint kept")
        if action == "skip_step":
            self._incident(finding, action, "update dropped, step counted")
        else:
            self._pending_rollback = finding
        return True

    def _watch(self, row: dict) -> bool:
        """The step's training signals: spikes, stragglers, a rollback the non-finite check asked for.
        Returns True if the run was rolled back."""
        step = self.state.step
        finding, self._pending_rollback = self._pending_rollback, None
        if finding is None and not row["skipped"]:
            finding = self.spikes.check(step, row["loss"])
        slow = straggler(step, row["host_time"], self.policy.training)
        if slow is not None and slow.subject != self._straggler:
            # once when a rank starts to straggle, not at every step it goes on straggling
            self._incident(slow, self.policy.decide(slow).action, "reported")
        self._straggler = slow.subject if slow is not None else None
        if finding is None:
            return False
        action = self.policy.decide(finding).action if finding.signal == "loss_spike" else "rollback"
        if action == "stop":
            self._incident(finding, action, "stopping; last checkpoint kept")
            raise ZayaError(f"{finding.line}; stopping (policy), last checkpoint kept")
        if action != "rollback":
            self._incident(finding, action, "recorded")
            return False
        return self._rollback(finding)

    def _rollback(self, finding: Finding) -> bool:
        """Go back to the newest checkpoint before this step and never train on the recent steps' data."""
        self.manager.wait()
        step, phase = self.state.step, self.phases[self.state.phase].name
        target = self.manager.newest_valid(log=self._say)
        if target is None or ckpt.read_json(target / ckpt.CONFIG_FILE).get("step", 0) >= step:
            self._incident(finding, "rollback", "no earlier checkpoint to roll back to; carrying on")
            return False
        start, stop = (self._windows[0][0], self._windows[-1][1]) if self._windows else (0, 0)
        self.heartbeat.beat("checkpoint_load", step)
        self.loader.close()
        self.metrics.close()
        self._restore(target)
        self.loader = self._loader(self.state.phase)
        if self.phases[self.state.phase].name == phase and stop > start:
            self.loader.add_skip_range(start, stop)
        current = self.phases[self.state.phase]
        if current.rope_theta:
            self.model.set_rope_theta(current.rope_theta)
        self.flops_per_token = training_flops_per_token(self.model_config, current.seq_len)
        self.sequence = self._sequence(current)
        self._windows = []
        self.metrics = self._open_metrics()
        self._incident(finding, "rollback", f"rolled back to step {self.state.step}; samples [{start}, {stop}) "
                       "are skipped")
        return True
