"""`zaya supervise -- COMMAND...`: run the worker group, watch it, and recover on its own.

The loop, every `supervisor.poll_s`:

    the group exited 0                     -> done (exit 0)
    the group exited otherwise             -> classify this run's log (+ the kernel log) -> policy
    a rank's heartbeat is late             -> hang -> policy (the group is SIGKILLed: it is stuck anyway)
    a probe finds something (ECC, NIC, disk) -> policy
    another node's supervisor cordoned its node -> restart here with one node fewer

and the policy's action: restart in place, cordon a GPU (restart with one process fewer and that GPU hidden),
cordon this node (stop here; the other nodes' supervisors go on without it), stop, or just log. Every decision
goes to `STATE_DIR/incidents.jsonl`, and once the run gets past the step it failed at, a "recovered" record
with the time it took.

Progress is the highest step a heartbeat reported. A run that fails without getting past the previous run's
highest step makes no progress; `supervisor.max_no_progress` such runs in a row end the supervisor.

Exit codes (EXIT_*): 0 training finished; 2 bad input (ours, or the trainer's before its first step);
3 no progress after K restarts; 4 stopped by policy (a `stop` rule, or this node cordoned); 5 nothing left to
run on (every GPU cordoned, or `supervisor.max_restarts` spent); 75 the trainer stopped early with a checkpoint
(train.max_time_s, or a scheduler's signal: resubmit to resume); 130/143 interrupted (SIGINT/SIGTERM: the group
gets SIGTERM and `supervisor.stop_grace_s` to finish its step and write a checkpoint).

The state directory (shared by the supervisors of all nodes of a job, on a shared filesystem):

    incidents.jsonl                        every decision, appended (zaya.resilience.incidents)
    cordon.json                            {"gpus": {node: [index, ...]}, "nodes": [node, ...]}
    heartbeats/NODE/run-N/rank-R.json      the ranks' heartbeats of run N (zaya.resilience.heartbeat)
    logs/NODE/run-N.log                    everything the group printed in run N, each line cut at 64 KiB

What zaya finds there is checked before it is used (zaya.resilience.statedir): a link, a FIFO or a device where
one of its files or directories goes is one line before the group starts; a heartbeat that is not one is
ignored with a note; the supervisor removes only heartbeat files it recognises. The group's output is read as it
comes, each line cut (zaya.resilience.output), so nothing it prints grows the supervisor.

When a run ends, whatever way (finished, failed, hung, restarted, stopped, or the supervisor interrupted), every
process of it is ended: SIGTERM, the grace period, SIGKILL. A run's processes are those below its first process,
the members of its session and process group that are ours, and any process that carries the run's mark in its
environment (zaya.resilience.processes): a worker's background child, one that called setsid, a rank whose
torchrun died.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zaya.device import visible_devices, visible_devices_env
from zaya.errors import (
    EXIT_BAD_INPUT,
    EXIT_EXHAUSTED,
    EXIT_NO_PROGRESS,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    STOPPED_LINE,
    ZayaError,
)
from zaya.reading import os_reason
from zaya.resilience.command import WorkerCommand
from zaya.resilience.diagnose import classify_lines
from zaya.resilience.findings import Finding, clip
from zaya.resilience.heartbeat import HeartbeatWatcher
from zaya.resilience.incidents import IncidentLog, check_incidents_file
from zaya.resilience.output import GroupOutput
from zaya.resilience.policy import TRAINING_ACTIONS, Policy
from zaya.resilience.probes import build_probes
from zaya.resilience.processes import attempt_processes, descendants, end_group, process_state
from zaya.resilience.readings import ReadError, run_command
from zaya.resilience.statedir import (
    CORDON_FILE,
    check_file,
    clear_beats,
    make_dirs,
    open_append,
    read_cordon,
    write_cordon,
)
from zaya.resilience.supervision import MARK_ENV, Supervision
from zaya.run_dir import INCIDENTS_FILE, SUPERVISOR_DIR


@dataclass
class Outcome:
    """Why a watched run ended: the group exited (`code`) or the supervisor ended it (`finding`, `action`)."""

    code: int | None = None
    finding: Finding | None = None
    action: str = ""


@dataclass
class _Run:
    """One start of the worker group."""

    process: subprocess.Popen
    watcher: HeartbeatWatcher
    output: GroupOutput
    cordoned: int  # nodes cordoned by others when it started
    mark: str  # its mark in the environment of each of its processes
    ended: bool = False
    started: float = field(default_factory=time.time)

    def lines(self) -> list[str]:
        return self.output.lines()


class Supervisor:
    """Runs `command` until it finishes, recovering from what `policy` says it may recover from."""

    def __init__(self, command: list[str], policy: Policy, state_dir: Path, *, environ: Mapping[str, str],
                 node: str | None = None, policy_file: Path | None = None, say=print):
        self.command = WorkerCommand(command)  # checks torchrun's sizes before anything is sized from them
        self.policy = policy
        self.policy_file = policy_file
        self.state_dir = Path(state_dir)
        self.node = node or socket.gethostname()
        if not _NODE_NAME.fullmatch(self.node) or self.node in (".", ".."):
            raise ZayaError(f"--node {self.node[:80]!r}: a node name is letters, digits, '.', '_' and '-' (it names "
                            "directories of the state directory)")
        self.say = say
        self.incidents = IncidentLog(self.state_dir / INCIDENTS_FILE)
        self.probes = build_probes(policy.probes)
        self.base_env = dict(environ)  # what the group inherits, with the supervision settings on top
        nproc = self.command.nproc_per_node()
        self.gpus = visible_devices(self.base_env) or (list(range(nproc)) if nproc else [])
        self.nodes = self.command.nnodes()[1]
        self.attempt = 0
        self.best_step = -1
        self.no_progress = 0
        self._recovering: dict | None = None  # the incident the current run recovers from
        self._run_best = -1  # the highest step of the current run
        self._pending: list[Finding] = []  # findings of the probes' first poll
        self._stop = None
        self._kernel_seen = 0
        self._cordon_seen: dict | None = None  # the last cordon file that could be read
        self._noted: set[str] = set()  # warnings said once

    def _note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self.say(text)

    # ---- the state shared between nodes -----------------------------------------------------------------

    def _cordon(self) -> dict:
        """The cordon file; while the group runs, one that cannot be read is noted and the last reading kept (the
        supervisor must go on watching), before the first start it is an error."""
        try:
            self._cordon_seen = read_cordon(self.state_dir / CORDON_FILE)
        except ZayaError as exc:
            if self._cordon_seen is None:
                raise
            self._note(f"warning: {exc}; the last reading of it stands")
        return {"gpus": dict(self._cordon_seen["gpus"]), "nodes": list(self._cordon_seen["nodes"])}

    def _write_cordon(self, data: dict) -> None:
        write_cordon(self.state_dir / CORDON_FILE, data)
        self._cordon_seen = data

    def _resources(self) -> tuple[list[int], int]:
        """The GPUs of this node and the number of nodes still usable."""
        cordon = self._cordon()
        gone = set(cordon["gpus"].get(self.node, []))
        others = [n for n in cordon["nodes"] if n != self.node]
        return [g for g in self.gpus if g not in gone], self.nodes - len(others)

    def _prepare(self) -> None:
        """The state directory made, and what it holds of ours checked, before anything starts."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ZayaError(f"--state-dir {self.state_dir}: cannot make it ({os_reason(exc)})") from None
        if not self.state_dir.is_dir():
            raise ZayaError(f"--state-dir {self.state_dir}: not a directory")
        check_incidents_file(self.incidents.path)
        check_file(self.state_dir / CORDON_FILE, "the cordon file")
        self._cordon()

    # ---- one run of the worker group ----------------------------------------------------------------------

    def _start(self) -> _Run:
        # one reading of cordon.json sizes the command and is what `_watch` compares against: a node cordoned
        # just after it then means one restart more, never a run that waits for a node that is gone
        cordoned = self._cordon_count()
        gpus, nodes = self._resources()
        nproc = len(gpus) if self.command.torchrun and self.gpus else None
        argv = self.command.resized(nproc, nodes if nodes != self.nodes else None)
        beats = make_dirs(self.state_dir, "heartbeats", self.node, f"run-{self.attempt}")
        clear_beats(beats)  # a state dir used before: its old beats would look hung
        log = open_append(make_dirs(self.state_dir, "logs", self.node) / f"run-{self.attempt}.log", "a run's log")
        supervision = Supervision(heartbeat_dir=beats, incidents_file=self.incidents.path,
                                  policy_file=self.policy_file, run_attempt=self.attempt)
        mark = f"{os.getpid()}-{self.attempt}-{secrets.token_hex(8)}"
        env = {**self.base_env, **supervision.environ(), MARK_ENV: mark}
        if self.gpus and gpus != self.gpus:
            env.update(visible_devices_env(gpus))
        self.say(f"run {self.attempt}: {' '.join(argv)}")
        try:
            process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=_die_with_us if _PRCTL else None)
        except OSError as exc:
            os.close(log)
            raise ZayaError(f"zaya supervise: cannot start '{argv[0][:200]}' ({os_reason(exc)})") from None
        except BaseException:
            os.close(log)
            raise
        output = GroupOutput(process.stdout.read1, log)
        watcher = HeartbeatWatcher(beats, self.policy.heartbeat, note=self._note)
        return _Run(process, watcher, output, cordoned, mark)

    def _cordon_count(self) -> int:
        return len([n for n in self._cordon()["nodes"] if n != self.node])

    def _poll_probes(self) -> list[Finding]:
        findings = []
        for probe in self.probes:
            try:
                findings += probe.poll()
            except (OSError, ValueError) as exc:  # a probe reads what the machine shows; the watch goes on
                self._note(f"warning: the {probe.name} probe could not read: {clip(str(exc), 200)}")
        return findings

    def _watch(self, run: _Run) -> Outcome:
        """Poll until the run ends or a finding calls for an action other than `log`."""
        poll = self.policy.supervisor.poll_s
        logged_hangs: set[str] = set()  # a hang the policy only logs is seen at every poll: recorded once
        while True:
            if self._stop is not None:
                return Outcome(finding=Finding("interrupted", "", f"supervisor got {self._stop.name}"),
                               action="stop")
            code = run.process.poll()
            self._note_progress(run.watcher)
            if code is not None:
                run.output.join(0.5)  # the last lines; a background child may hold the pipe open
                return Outcome(code=code)
            findings, self._pending = [*self._pending, *self._poll_probes()], []
            hang = run.watcher.poll()
            if hang is not None:
                findings.append(hang)
            if self._cordon_count() != run.cordoned:  # another node's supervisor decided: go on without it
                gone = [n for n in self._cordon()["nodes"] if n != self.node]
                subject = gone[-1] if gone else "?"
                return Outcome(finding=Finding("node_cordoned", f"node:{subject}",
                                               f"node {subject} was cordoned by its supervisor"), action="restart")
            for finding in findings:
                rule = self.policy.decide(finding)
                action = "restart" if rule.action in TRAINING_ACTIONS else rule.action
                if action == "log":
                    if finding.signal == "hang":
                        if finding.subject in logged_hangs:
                            continue
                        logged_hangs.add(finding.subject)
                    self._record(finding, "log", "recorded")
                    continue
                return Outcome(finding=finding, action=action)
            time.sleep(poll)

    def _note_progress(self, watcher: HeartbeatWatcher) -> None:
        step = watcher.progress()
        if self._recovering is not None and step > self._recovering["step"]:
            took = time.time() - self._recovering["detected"]
            self.incidents.append({"event": "recovered", "source": "supervisor", "attempt": self.attempt,
                                   "step": step, "signal": self._recovering["signal"],
                                   "seconds": round(took, 3),
                                   "outcome": f"past step {self._recovering['step']} again {took:.1f} s after "
                                              f"the {self._recovering['signal']} was detected"})
            self.say(f"recovered: step {step} reached, {took:.1f} s after detection")
            self._recovering = None
        self._run_best = max(self._run_best, step)

    def _end(self, run: _Run, *, graceful: bool, grace: float) -> None:
        """End every process of `run`: SIGTERM and `grace` seconds to exit (unless `graceful` is False: a hung
        group, or the supervisor failing), then SIGKILL for all that are left and any they started meanwhile."""
        if run.ended:
            return
        run.ended = True
        process = run.process
        # ranks orphaned by a dead torchrun, found by their heartbeats, are signalled only if they are ours (a
        # heartbeat file holds whatever pid was written into it)
        ours = set(descendants(os.getpid()))
        beat_pids = {beat["pid"] for beat in run.watcher.beats().values() if beat["pid"] in ours}

        def alive() -> set[int]:
            found = attempt_processes(process.pid, run.mark, leader_reaped=process.returncode is not None)
            return found | {pid for pid in beat_pids if process_state(pid) not in (None, "Z")}

        end_group(process, alive, graceful=graceful, grace=grace)
        run.output.join(2.0)  # every writer of the pipe is gone: the last lines reach the log

    # ---- decisions ------------------------------------------------------------------------------------------

    def _record(self, finding: Finding, action: str, outcome: str, evidence: list[str] | None = None) -> None:
        record = {"source": "supervisor", "node": self.node, "signal": finding.signal, "subject": finding.subject,
                  "evidence": evidence or [finding.line], "detail": finding.detail, "action": action,
                  "outcome": outcome, "step": self._run_best, "attempt": self.attempt}
        try:
            self.incidents.append(record)
        except (ZayaError, OSError) as exc:  # the decision stands; the run's story goes on in our output
            self._note(f"warning: incident not recorded: {exc}")
        self.say(f"incident: {finding.signal}{f' {finding.subject}' if finding.subject else ''}: "
                 f"{clip(finding.line)} -> {action}: {outcome}")

    def _kernel_lines(self) -> list[str]:
        command = self.policy.supervisor.kernel_log
        if not command:
            return []
        try:
            text = run_command(command, 10.0).stdout
        except ReadError as exc:
            self._note(f"warning: supervisor.kernel_log: {exc}")
            return []
        lines = text.splitlines()
        new, self._kernel_seen = lines[self._kernel_seen:], len(lines)
        return new

    def _diagnose(self, code: int, tail: list[str]) -> Finding:
        diagnosis = classify_lines([*self._kernel_lines(), *tail])
        finding = diagnosis.finding()
        if not finding.line:
            finding = Finding(diagnosis.root, finding.subject, f"the worker group exited with code {code}",
                              f"{len(diagnosis.cascade)} cascade line(s), no root cause in the log")
        return finding

    def run(self) -> int:
        """Supervise until the run finishes or cannot go on; returns the exit code."""
        self._prepare()
        self._kernel_lines()  # what the kernel said before we started is history
        # the probes' first poll is their baseline: counters already non-zero are history and not reported,
        # but a state that is bad now (a link down, a full disk) is, and is acted on before the first start
        self._pending = self._poll_probes()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self._stop = signal.Signals(signum)

    def _loop(self) -> int:
        while True:
            gpus, nodes = self._resources()
            if self.node in self._cordon()["nodes"]:
                self.say("this node is cordoned; stopping here")
                return EXIT_STOPPED
            if (self.gpus and not gpus) or nodes < 1:
                self.say("nothing left to run on: every GPU or node is cordoned")
                return EXIT_EXHAUSTED
            self._run_best = -1
            run = self._start()
            try:
                code = self._attempt(run)
            finally:  # whatever way the attempt ended, nothing of it outlives it
                self._end(run, graceful=False, grace=0.0)
            if code is not None:
                return code
            self.attempt += 1

    def _attempt(self, run: _Run) -> int | None:
        """Watch one run to its end and act on it; an exit code ends the supervisor, None starts the next run."""
        settings = self.policy.supervisor
        outcome = self._watch(run)
        if outcome.code == 0:
            self._note_progress(run.watcher)
            self._end(run, graceful=True, grace=settings.kill_grace_s)
            self.say(f"run {self.attempt}: finished")
            return EXIT_OK
        if outcome.code == EXIT_PREEMPTED or any(STOPPED_LINE in line for line in run.lines()[-20:]):
            # torchrun reports a worker's exit 75 as a failure of its own: the trainer's line tells
            self._note_progress(run.watcher)
            self._end(run, graceful=True, grace=settings.kill_grace_s)
            self.say(f"run {self.attempt}: stopped early with a checkpoint; resubmit to resume")
            return EXIT_PREEMPTED
        detected = time.time()
        finding, action = outcome.finding, outcome.action
        if finding is None:  # the group died on its own
            tail = run.lines()
            finding = self._diagnose(outcome.code, tail)
            # a mistake in the config shows at once, in the first run; a later start-up failure (a peer that
            # did not join in time) is worth a restart
            if self.attempt == 0 and self._run_best < 0 and any("zaya: error" in line for line in tail):
                self._end(run, graceful=True, grace=settings.kill_grace_s)
                self._record(finding, "stop", "bad input before the first step: no restart can fix it",
                             [finding.line])
                return EXIT_BAD_INPUT
            rule = self.policy.decide(finding)
            action = "restart" if rule.action in (*TRAINING_ACTIONS, "log") else rule.action
        interrupted = finding.signal == "interrupted"
        self._end(run, graceful=finding.signal != "hang",
                  grace=settings.stop_grace_s if interrupted else settings.kill_grace_s)
        if interrupted:
            return 128 + self._stop.value
        progressed = self._run_best > self.best_step
        self.best_step = max(self.best_step, self._run_best)
        self.no_progress = 0 if progressed else self.no_progress + 1
        if action not in ("stop", "cordon_node"):  # the actions that start the group again
            if self.no_progress >= settings.max_no_progress:
                self._record(finding, "stop", f"no progress past step {self.best_step} in {self.no_progress} "
                             f"runs in a row (the policy said {action})")
                return EXIT_NO_PROGRESS
            if self.attempt + 1 > settings.max_restarts:
                self._record(finding, "stop", f"supervisor.max_restarts ({settings.max_restarts}) spent "
                             f"(the policy said {action})")
                return EXIT_EXHAUSTED
        code = self._act(finding, action, detected - run.started)
        if code is None:
            self._recovering = {"step": max(self._run_best, 0), "detected": detected, "signal": finding.signal}
        return code

    def _act(self, finding: Finding, action: str, ran_for: float) -> int | None:
        """Carry out `action` (the group is already down); an exit code ends the supervisor."""
        if action == "stop":
            self._record(finding, "stop", "stopped by policy")
            return EXIT_STOPPED
        if action == "cordon_node":
            cordon = self._cordon()
            cordon["nodes"] = sorted({*cordon["nodes"], self.node})
            self._write_cordon(cordon)
            self._record(finding, "cordon_node", f"node {self.node} cordoned; the other nodes go on without it")
            return EXIT_STOPPED
        if action == "cordon_gpu":
            gpu = finding.gpu
            if gpu is None or gpu not in self.gpus:
                self._record(finding, "restart", f"no GPU of this node named by '{finding.subject}'; restarted")
                return None
            cordon = self._cordon()
            cordon["gpus"][self.node] = sorted({*cordon["gpus"].get(self.node, []), gpu})
            self._write_cordon(cordon)
            left = self._resources()[0]
            self._record(finding, "cordon_gpu", f"GPU {gpu} cordoned; restarting on {len(left)} GPU(s) {left}")
            return None
        _gpus, nodes = self._resources()
        self._record(finding, "restart", f"restarting (run {self.attempt + 1}) after {ran_for:.1f} s"
                     + (f" on {nodes} node(s)" if nodes != self.nodes else ""))
        return None


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # Linux; looked up here, not in the forked child
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}")


def _adopt_orphans() -> None:
    """Become the subreaper of the groups we start: a worker whose torchrun died is reparented to us, not to init,
    so it stays in our process tree, the only processes we ever signal."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_CHILD_SUBREAPER, 1)


def _die_with_us() -> None:
    """In the group's first process, before exec: SIGTERM when the supervisor dies, so that a supervisor killed
    by a person or the OOM killer does not leave a group running unwatched (torchrun passes it on)."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def default_state_dir(command: list[str]) -> Path:
    """RUN_DIR/supervisor when the command names `--run-dir RUN_DIR`, else ./supervisor."""
    for index, arg in enumerate(command):
        if arg == "--run-dir" and index + 1 < len(command):
            return Path(command[index + 1]) / SUPERVISOR_DIR
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1]) / SUPERVISOR_DIR
    return Path(SUPERVISOR_DIR)


def supervise(command: list[str], policy_file: Path | None, state_dir: Path | None, node: str | None, *,
              environ: Mapping[str, str]) -> int:
    """What `zaya supervise` does: load the policy, check the command, supervise; returns the exit code."""
    policy = Policy.load(policy_file)
    _adopt_orphans()
    supervisor = Supervisor(command, policy, state_dir or default_state_dir(command), environ=dict(environ),
                            node=node, policy_file=policy_file)
    return supervisor.run()

