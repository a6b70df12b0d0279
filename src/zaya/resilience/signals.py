"""Training signals the trainer watches itself, on numbers every rank already has (no extra collective).

    non-finite   the global gradient norm is NaN or inf (a NaN loss makes NaN gradients): the step's update
                 is dropped, parameters and optimizer state stay as they were, the step still counts
    loss spike   loss > spike_ratio x the median of the last `spike_window` finite losses (after
                 `spike_min_history` of them): roll back to the last checkpoint and never train on the data
                 of the last `spike_skip_steps` steps (the loader's skip ranges)
    straggler    a rank's own host time in a step (its data and host work before the first collective, where
                 nobody waits for anybody) above straggler_ratio x the median rank's, by straggler_min_s
    expert collapse
                 a MoE layer's busiest expert above collapse_ratio x the mean expert load (the step's route counts,
                 over every rank) in collapse_steps steps in a row: reported once, again only after the layer
                 has recovered
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


class CollapseWatch:
    """Counts, per MoE layer, the steps in a row whose busiest expert stands out (see the module docstring)."""

    def __init__(self, settings: TrainingSettings):
        self.settings = settings
        self.in_row: list[int] = []  # per layer
        self.reported: set[int] = set()  # layers reported and not recovered since

    def check(self, step: int, imbalance: list[float]) -> Finding | None:
        """An `expert_collapse` finding naming the layers that have just reached `collapse_steps`, if any."""
        s = self.settings
        if len(self.in_row) != len(imbalance):
            self.in_row = [0] * len(imbalance)
        newly = []
        for layer, ratio in enumerate(imbalance):
            if ratio > s.collapse_ratio:
                self.in_row[layer] += 1
            else:
                self.in_row[layer] = 0
                self.reported.discard(layer)
            if self.in_row[layer] >= max(1, s.collapse_steps) and layer not in self.reported:
                self.reported.add(layer)
                newly.append(layer)
        if not newly:
            return None
        worst = max(imbalance[layer] for layer in newly)
        layers = ", ".join(str(layer) for layer in newly)
        return Finding("expert_collapse", f"layer:{newly[0]}",
                       f"step {step}: experts collapsing in MoE layer{'s' if len(newly) > 1 else ''} {layers}: the "
                       f"busiest expert took more than {s.collapse_ratio:g} x the mean load in "
                       f"{max(1, s.collapse_steps)} steps in a row (up to {worst:.2f} x now)",
                       "lower optim.vector_lr_ratio or the learning rate (docs/design.md, \"Optimizer\")",
                       count=len(newly))


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
