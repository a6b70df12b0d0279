"""What a supervisor hands the trainers it starts, through their environment: where each rank writes its
heartbeat, where the trainer appends its own incidents, the policy file, the supervisor's restart count, and
(in tests) the faults to inject.

The supervisor writes these variables (`Supervision.environ`); the `zaya` command alone reads them
(`Supervision.from_environ`) and hands the settings down, so that nothing deeper reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_ENV = "ZAYA_HEARTBEAT_DIR"
INCIDENTS_ENV = "ZAYA_INCIDENTS"
POLICY_ENV = "ZAYA_POLICY"
RUN_ATTEMPT_ENV = "ZAYA_RUN_ATTEMPT"
FAULTS_ENV = "ZAYA_FAULTS"  # test-only: zaya.resilience.faults
FAULT_LINE_ENV = "ZAYA_FAULT_LINE"  # the line the `print` fault prints
# the supervisor's mark on one start of a group ("PID-ATTEMPT-TOKEN"): every process of the group inherits it, so
# the supervisor finds the ones that left the group's session (zaya.resilience.processes); nothing reads it as a
# setting
MARK_ENV = "ZAYA_SUPERVISED"


@dataclass(frozen=True)
class Supervision:
    """The supervisor's settings for one worker group; the defaults are those of a run nobody supervises."""

    heartbeat_dir: Path | None = None  # None: no heartbeats
    incidents_file: Path | None = None  # None: RUN_DIR/incidents.jsonl
    policy_file: Path | None = None  # None: the built-in policy
    run_attempt: int = 0  # the supervisor's restart count
    faults: str = ""  # zaya.resilience.faults syntax
    fault_line: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Supervision:
        def path(name: str) -> Path | None:
            return Path(environ[name]) if environ.get(name) else None

        attempt = environ.get(RUN_ATTEMPT_ENV, "").strip()
        return cls(heartbeat_dir=path(HEARTBEAT_ENV), incidents_file=path(INCIDENTS_ENV),
                   policy_file=path(POLICY_ENV),
                   run_attempt=int(attempt) if attempt.isascii() and attempt.isdigit() and len(attempt) <= 9 else 0,
                   faults=environ.get(FAULTS_ENV, ""), fault_line=environ.get(FAULT_LINE_ENV, ""))

    def environ(self) -> dict[str, str]:
        """The variables that give a worker group these settings (faults travel in the inherited environment)."""
        values = {HEARTBEAT_ENV: self.heartbeat_dir, INCIDENTS_ENV: self.incidents_file,
                  POLICY_ENV: self.policy_file.resolve() if self.policy_file else None,
                  RUN_ATTEMPT_ENV: self.run_attempt}
        return {name: str(value) for name, value in values.items() if value is not None}
