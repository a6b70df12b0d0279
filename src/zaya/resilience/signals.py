"""Training signals the trainer watches itself, on numbers every rank already has (no extra collective).

    non-finite   the global gradient norm is NaN or inf (a NaN loss makes NaN gradients): the step's update
                 is dropped, parameters and optimizer state stay as they were, the step still counts
    loss spike   loss > spike_ratio x the median of the last `spike_window` finite losses (after
                 `spike_min_history` of them): roll back to the last checkpoint and never train on the data
                 of the last `spike_skip_steps` steps (the loader's skip ranges)
    straggler    a rank's own host time in a step (its data and host work before the first collective, where
                 nobody waits for anybody) above straggler_ratio x the median rank's, by straggler_min_s
"""

from __future__ import annotations

import statistics
from collections import deque

from zaya.resilience.findings import Finding
from zaya.resilience.policy import TrainingSettings


class SpikeDetector:
    """Judges each step's loss against the median of the recent finite losses."""

    def __init__(self, settings: TrainingSettings):
        self.settings = settings
        self.history: deque[float] = deque(maxlen=max(1, settings.spike_window))

    def check(self, step: int, loss: float) -> Finding | None:
        """A `loss_spike` finding if `loss` is a spike; otherwise the loss joins the history."""
        s = self.settings
        if len(self.history) >= max(1, s.spike_min_history):
            baseline = statistics.median(self.history)
            if baseline > 0 and loss > s.spike_ratio * baseline:
                return Finding("loss_spike", "", f"step {step}: loss {loss:.4f} > {s.spike_ratio:g} x median "
                               f"{baseline:.4f} of the last {len(self.history)} steps",
                               f"{loss / baseline:.2f}x the recent median")
        self.history.append(loss)
        return None


def straggler(step: int, host_times: list[float], settings: TrainingSettings) -> Finding | None:
    """A `straggler` finding for the slowest rank, if its host time stands out from the median rank's."""
    if len(host_times) < 2:
        return None
    median = statistics.median(host_times)
    slowest = max(range(len(host_times)), key=host_times.__getitem__)
    worst = host_times[slowest]
    if worst > settings.straggler_ratio * median and worst - median > settings.straggler_min_s:
        shown = ", ".join(f"{t:.3f}" for t in host_times)
        return Finding("straggler", f"rank:{slowest}",
                       f"step {step}: rank {slowest} took {worst:.3f} s of host time against a median of "
                       f"{median:.3f} s (per rank: {shown})", f"{worst / max(median, 1e-9):.1f}x the median rank")
    return None


def as_ranges(positions) -> list[list[int]]:
    """Sorted integer positions as [start, stop) runs: a step's batch in a few numbers."""
    runs: list[list[int]] = []
    for p in sorted(int(p) for p in positions):
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs
