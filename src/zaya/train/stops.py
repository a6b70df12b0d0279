"""Runs that survive the scheduler: a stop request (SIGTERM, SIGUSR1, a wall-clock limit) ends the run after
the current step with a checkpoint, and the process exits with `EXIT_PREEMPTED` so that a resubmitted job
resumes with nothing lost; a time budget times the learning-rate decay.

    SIGTERM, SIGUSR1      what schedulers send before they kill (Slurm's `--signal`, Kubernetes, torchrun
                          passing on its own SIGTERM): the current step finishes, a checkpoint is written,
                          exit 75. More of them change nothing: a scheduler signals every process of the
                          job and torchrun passes its copy on, so duplicates are the rule. Whoever cannot
                          wait sends SIGKILL; the last committed checkpoint is intact, as commits are atomic.
    SIGINT (Ctrl-C)       once the training loop runs, the same as SIGTERM, said at once; a second one aborts
                          there and then (KeyboardInterrupt: exit 130, the last committed checkpoint kept).
                          Before the loop (start-up, loading) Ctrl-C aborts as anywhere else, and a SIGINT
                          that the process inherited ignored (a background job) stays ignored.
    train.max_time_s      a wall-clock limit counted from the job's start (`time_origin`): the run stops
                          when the time left no longer covers one more step and a checkpoint (the slowest
                          recent step, the last save's duration), also with exit 75.
    train.time_budget_s   the run's wall time in all, summed over resumes: start-up, steps, evaluations
                          and checkpoints. The decay of the wsd schedule starts when the budget's last
                          `decay_fraction` begins and spans the time left (less the last evaluation's and
                          checkpoint's, which the end repeats) at the measured step rate, scaled by the
                          loop's own pace (`timed_decay`); the run then ends with the decay, exit 0.

Every rank takes the same decision: the requests travel in the step's one reduction of statistics (a signal
that reached any rank stops all of them at the same step), and every time figure is rank 0's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from zaya.data.ramp import BatchRamp
from zaya.optim.schedule import ScheduleConfig
from zaya.train.config import TrainSection
from zaya.train.stats import StepStats

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INTERRUPT_SAID = "stopping after this step with a checkpoint (Ctrl-C again to abort now)"
_RECENT = 10  # steps whose times estimate the next one's
_REPLAN_RECENT = 3  # steps whose times re-plan a timed decay's end


class StopRequest:
    """Catches SIGTERM and SIGUSR1 while training (and SIGINT, once `catch_interrupts` is called at the training
    loop's start) and records the first. Inert outside the main thread (Python delivers signals to it alone),
    where it cannot install handlers.

    A process blocked where no step ends (a read that never returns, a collective whose peers are gone) would
    never act on the request: `grace_s` after the first signal it exits at once with 128 + the signal, saying so
    (the handler runs even then: Python retries an interrupted call only after it). Later signals change
    nothing (a worker may get the same one from the scheduler and from torchrun), but a SIGINT after the request:
    a person pressed Ctrl-C twice and wants out now, so it raises KeyboardInterrupt where the process stands
    (`say` records that). `announce`: this process tells the person at the terminal (rank 0)."""

    def __init__(self, grace_s: float = 0.0, *, announce: bool = True,
                 say: Callable[[str], None] | None = None) -> None:
        self.signal: signal.Signals | None = None
        self.grace_s, self.announce, self.say = grace_s, announce, say
        self.aborted = False  # a second Ctrl-C raised KeyboardInterrupt
        self._previous: dict[int, object] = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> StopRequest:
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread
            self._previous.clear()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        if self.aborted and kind is KeyboardInterrupt and self.say is not None:
            self.say("aborted by a second Ctrl-C (SIGINT): the step in progress is lost; the last committed "
                     "checkpoint is kept, and the same command resumes from it")

    def catch_interrupts(self) -> None:
        """From now on until the exit, SIGINT is a stop request too. Only where it has Python's own meaning
        (KeyboardInterrupt): one the process inherited ignored stays so, and a handler of someone else's stays."""
        if self._previous and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self, signum: int, frame) -> None:
        if self.signal is None:
            if self.announce:  # a write(2) at once: a handler must not re-enter a `print` it interrupted
                below = "\n" if os.isatty(2) else ""  # below the terminal's ^C (or a progress bar)
                os.write(2, f"{below}zaya: {INTERRUPT_SAID}\n".encode())
            self._on_signal(signum, frame)
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a third Ctrl-C interrupts the clean-up
        self.aborted = True
        raise KeyboardInterrupt

    def _on_signal(self, signum: int, frame) -> None:
        if self.signal is not None:  # the same request again (Slurm and torchrun both pass signals on)
            return
        self.signal = signal.Signals(signum)
        if self.grace_s > 0:
            why = f"{self.grace_s:g} s after {self.signal.name}"
            self._deadline = threading.Timer(self.grace_s, self._give_up, (why,))
            self._deadline.daemon = True
            self._deadline.start()

    def _give_up(self, why: str) -> None:
        os.write(2, f"zaya: error: {why}, no checkpoint written (blocked in I/O or in a collective?); exiting "
                    f"without one: the run resumes from its last checkpoint\n".encode())
        os._exit(128 + self.signal.value)

    @property
    def requested(self) -> bool:
        return self.signal is not None


def time_origin(environ: Mapping[str, str]) -> float:
    """When the job started, as the wall clock (`time.time()`) counts, read from the process's environment:
    Slurm's job start if the job runs under Slurm (`SLURM_JOB_START_TIME`), else when the torchrun agent that
    started this process began (a restarted worker keeps the job's clock), else when this process began."""
    slurm = environ.get("SLURM_JOB_START_TIME", "")
    if slurm.isdigit() and len(slurm) <= 12:  # seconds since 1970: more digits are no time (and overflow a float)
        return float(slurm)
    pid = os.getppid() if "TORCHELASTIC_RESTART_COUNT" in environ else os.getpid()
    started = _process_start(pid)
    return started if started is not None else _PROCESS_START


def process_start() -> float:
    """When this process began, as the wall clock counts (where /proc tells; else when this module was imported)."""
    started = _process_start(os.getpid())
    return started if started is not None else _PROCESS_START


_PROCESS_START = time.time()  # the import's time: close to the process start where /proc is not available


def _process_start(pid: int) -> float | None:
    """The wall-clock start of process `pid`, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@dataclass
class StepClock:
    """Rank 0's recent step times and the last checkpoint's duration: the estimates every stop rule uses."""

    recent: list[float]
    save_seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.recent = [*self.recent, seconds][-_RECENT:]

    @property
    def step_seconds(self) -> float:
        """The next step's expected duration: the median of the recent ones (0 before the first)."""
        return statistics.median(self.recent) if self.recent else 0.0

    def needed(self) -> float:
        """Seconds one more step and a checkpoint take: the slowest recent step, and the last save's time or,
        before the first save, a guess of ten steps (a save writes the state once; a step reads and writes it
        several times, but from memory)."""
        slowest = max(self.recent, default=0.0)
        return slowest + (self.save_seconds if self.save_seconds else 10 * slowest)


def deadline_reached(max_time_s: float, origin: float, clock: StepClock, now: float | None = None) -> bool:
    """Whether a run limited to `max_time_s` seconds from `origin` must stop now to leave a checkpoint."""
    if max_time_s <= 0:
        return False
    now = time.time() if now is None else now
    return now - origin + clock.needed() >= max_time_s


def timed_decay(step: int, spent_s: float, budget_s: float, decay_fraction: float, warmup_steps: int,
                sample_seconds: float, planned_decay_start: int, samples: int = 0,
                batch_at: Callable[[int], int] = lambda samples: 1) -> int | None:
    """The total step count of a wsd schedule timed to a budget, once its decay is due, else None.

    The decay is due when `spent_s` reaches the budget's stable share, (1 - decay_fraction) * budget_s,
    after warmup and before the step-counted decay (`planned_decay_start`, from max_steps) would begin. It then
    takes the time left, at `sample_seconds` per sequence and the batch the ramp gives at each step
    (`batch_at(samples)`, from `samples` consumed), so the run ends about when the budget does even while the
    batch still grows."""
    if budget_s <= 0 or step < warmup_steps or step >= planned_decay_start or sample_seconds <= 0:
        return None
    if spent_s < (1.0 - decay_fraction) * budget_s:
        return None
    return step + steps_within(budget_s - spent_s, sample_seconds, samples, batch_at, planned_decay_start - step)


def steps_within(left_s: float, sample_seconds: float, samples: int, batch_at: Callable[[int], int],
                 limit: int) -> int:
    """How many steps (at least 1, at most `limit`) end nearest to `left_s` seconds from now, at `sample_seconds`
    per sequence and the batch the ramp gives from `samples` consumed on."""
    steps = 0
    while steps < limit:
        batch = batch_at(samples)
        if left_s < batch * sample_seconds / 2:  # the step that would end nearest the budget is the last
            break
        left_s, samples, steps = left_s - batch * sample_seconds, samples + batch, steps + 1
    return max(1, steps)


@dataclass
class Clock:
    """The run's time so far, by rank 0's clock; saved in every checkpoint, so that a resume keeps it."""

    train_seconds: float = 0.0  # time spent in steps, summed over resumes
    # wall time spent by the run (start-up, steps, evaluations, checkpoints), summed over resumes; what
    # train.time_budget_s counts
    run_seconds: float = 0.0
    step_times: list[float] = field(default_factory=list)  # the recent steps' times, for the stop rules
    sample_times: list[float] = field(default_factory=list)  # the same per sequence, for a timed decay
    save_seconds: float = 0.0  # how long the last checkpoint took
    eval_seconds: float = 0.0  # how long the last evaluation took
    # with train.time_budget_s, once the decay is timed: the step it began at and the schedule's last step
    decay_start: int = 0
    schedule_steps: int = 0


class StopRules:
    """The rules of the module docstring for one run: its clock, the signals it caught, and why it stopped, if it
    stopped early. `say` reports decisions."""

    def __init__(self, train: TrainSection, schedule: ScheduleConfig, ramp: BatchRamp, origin: float, *,
                 is_main: bool, say: Callable[[str], None], clock: Callable[[], float] = time.time,
                 started: float | None = None):
        self.train, self.base_schedule, self.ramp = train, schedule, ramp
        self.origin, self.clock_now = origin, clock  # train.max_time_s counts from `origin` by `clock`
        # this process's start by `clock` (default: now): its time joins the run's at the first step
        self.started = clock() if started is None else started
        self._earlier: float | None = None  # the run's wall time before this process (its checkpoint's)
        self._paced: tuple[float, float] | None = None  # (run_seconds, train_seconds) at the first timed step
        self.is_main, self.say = is_main, say
        self.clock = Clock()
        self.request = StopRequest(train.stop_grace_s, announce=is_main, say=say)
        self.stopped: str | None = None  # why the run stopped before its end, if it did
        self.last_seconds = 0.0  # rank 0's time of the step before, sent with the next step's statistics
        self.last_batch = 0  # that step's global batch (the same on every rank)

    def schedule(self) -> ScheduleConfig:
        """The learning-rate schedule: as configured, or with its decay timed to train.time_budget_s once that
        was decided (the decision is part of the checkpoint, so a resumed run keeps it)."""
        clock = self.clock
        if not clock.schedule_steps:
            return self.base_schedule
        decay = clock.schedule_steps - clock.decay_start
        return dataclasses.replace(self.base_schedule, total_steps=clock.schedule_steps,
                                   decay_fraction=decay / clock.schedule_steps)

    def end_step(self) -> int:
        """The step the run ends at: train.max_steps, or the end of a timed decay if that comes first."""
        return min(self.train.max_steps, self.clock.schedule_steps or self.train.max_steps)

    def stepped(self, seconds: float, batch: int) -> None:
        """Rank 0's time for the step just taken, of `batch` sequences: sent with the next step's statistics."""
        self.last_seconds, self.last_batch = seconds, batch

    def add_to(self, stats: StepStats) -> None:
        """What the step's reduction carries for these rules: a signal on any rank, rank 0's deadline and its
        time for the step before."""
        stats.sum("stop_signal", float(self.request.requested))
        stats.from_main("deadline", float(self.is_main and self.deadline()))
        stats.from_main("previous_seconds", self.last_seconds)
        if self._earlier is None:  # the first step of this process, after any resume replaced the clock
            self._earlier = self.clock.run_seconds
        stats.from_main("run_seconds", self._earlier + self.clock_now() - self.started)

    def take(self, reduced: dict, step: int, samples: int) -> str | None:
        """Apply what the step's reduction brought (the same on every rank): rank 0's time for the previous step
        and the time budget's decay decision; returns why the run must stop after this step, if it must."""
        previous, clock = float(reduced["previous_seconds"]), self.clock
        clock.run_seconds = float(reduced["run_seconds"])
        if previous > 0 and self.last_batch:
            clock.train_seconds += previous
            clock.step_times = [*clock.step_times, previous][-_RECENT:]
            clock.sample_times = [*clock.sample_times, previous / self.last_batch][-_RECENT:]
            if self._paced is None:
                self._paced = (clock.run_seconds, clock.train_seconds)
        train, schedule = self.train, self.base_schedule
        if train.time_budget_s and clock.schedule_steps and clock.sample_times:
            # the last few steps' rate: a change of load shows in two steps, where the ten-step median lags
            self._replan(step, samples, statistics.median(clock.sample_times[-_REPLAN_RECENT:]) * self.pace())
        elif train.time_budget_s and clock.sample_times:
            planned = schedule.total_steps - schedule.decay_steps
            rate = statistics.median(clock.sample_times) * self.pace()
            total = timed_decay(step, clock.run_seconds, self.budget_s(), schedule.decay_fraction,
                                schedule.warmup_steps, rate, planned, samples, self.ramp.at)
            if total is not None:
                clock.decay_start, clock.schedule_steps = step, total
                self.say(f"time budget: {clock.run_seconds:.0f} of {train.time_budget_s:.0f} s spent; the "
                         f"decay runs from step {step} to step {total} (the rest of the budget at "
                         f"{rate * 1e3:.1f} ms per sequence, evaluations and checkpoints included, with the "
                         "batch ramp; re-planned as the rate changes)")
        if reduced["stop_signal"]:
            return "signal"
        return "max_time_s" if reduced["deadline"] else None

    def pace(self) -> float:
        """The loop's wall time per second of steps in this process (at least 1): evaluations, checkpoints and
        logging between the steps take their share of the budget as the steps take theirs."""
        if self._paced is None:
            return 1.0
        stepped = self.clock.train_seconds - self._paced[1]
        return max(1.0, (self.clock.run_seconds - self._paced[0]) / stepped) if stepped > 0 else 1.0

    def budget_s(self) -> float:
        """The time budget less what its end costs after the last step: an evaluation and a checkpoint."""
        end = self.clock.save_seconds + (self.clock.eval_seconds if self.train.eval_every else 0.0)
        return self.train.time_budget_s - end

    def eta_seconds(self, step: int) -> float | None:
        """The time the run has left after `step`, by rank 0's clock: the rest of the time budget until its decay
        is timed, else the steps left at the median recent step's time (None before a step was timed)."""
        clock = self.clock
        if self.train.time_budget_s and not clock.schedule_steps:
            return max(0.0, self.train.time_budget_s - clock.run_seconds)
        if not clock.step_times:
            return None
        return max(0, self.end_step() - step) * statistics.median(clock.step_times)

    def _replan(self, step: int, samples: int, rate: float) -> None:
        """While a timed decay runs: move its end to where the rest of the budget ends at the recent rate, so that
        a machine that slows down or speeds up still ends the run with its budget. Never so far out that the
        learning rate would rise again (the decay's progress t never goes back), never past train.max_steps."""
        clock = self.clock
        start, end = clock.decay_start, clock.schedule_steps
        if step >= end:
            return
        left = self.budget_s() - clock.run_seconds
        planned = step + steps_within(left, rate, samples, self.ramp.at, self.train.max_steps - step)
        if step > start:  # the next step's t, (step + 1 - start) / (end - start), may not fall below the last one's
            planned = min(planned, start + (step + 1 - start) * (end - start) // (step - start))
        planned = max(planned, step + 1)
        if planned != end:
            clock.schedule_steps = planned
            if abs(planned - end) * 10 >= max(1, end - start):  # said when it moves by a tenth of the decay
                self.say(f"time budget: the decay now ends at step {planned}, not {end} (the rest of the "
                         f"budget, {max(0.0, left):.0f} s, at {rate * 1e3:.1f} ms per sequence)")

    def deadline(self) -> bool:
        """Must the run stop now to leave a checkpoint before train.max_time_s (by this process's clock)?"""
        clock = StepClock(self.clock.step_times, self.clock.save_seconds)
        return deadline_reached(self.train.max_time_s, self.origin, clock, now=self.clock_now())

    def finish(self, step: int) -> None:
        """The run reached its end at `step` (it did not stop early): said in the log, which `zaya diagnose` reads."""
        spent = " (its time budget is spent)" if step < self.train.max_steps else ""
        self.say(f"finished at step {step}: the run is complete{spent}")

    def stop(self, reason: str, step: int, committed: bool) -> None:
        """The run stops early with its checkpoint of `step` committed (or with nothing trained yet): say why and
        what resumes it."""
        self.stopped = self.request.signal.name if reason == "signal" and self.request.signal else reason
        if reason == "signal" and self.request.signal is None:
            self.stopped = "a signal to another rank"
        limit = f" (train.max_time_s = {self.train.max_time_s:g} s)" if reason == "max_time_s" else ""
        kept = (f"checkpoint step {step} is committed; the same command resumes from it" if committed
                else "nothing was trained yet")
        self.say(f"stopping at step {step} on {self.stopped}{limit}: {kept}")
