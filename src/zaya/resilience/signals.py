"""Training signals the trainer watches itself, on numbers every rank already has (no extra collective).

    non-finite   the global gradient norm is NaN or inf (a NaN loss makes NaN gradients): the step's update
                 is dropped, parameters and optimizer state stay as they were, the step still counts
    loss spike   loss > spike_ratio x the median of the last `spike_window` finite losses (after
                 `spike_min_history` of them): roll back to the last checkpoint and never train on the data
                 of the last `spike_skip_steps` steps (the loader's skip ranges)
    straggler    a rank's own host time in a step (its data and host work before the first collective, where
                 nobody waits for anybody) above straggler_ratio x the median rank's, by straggler_min_s
    expert collapse
                 a MoE layer's busiest expert above collapse_ratio x the mean expert load, the load averaged over
                 the last collapse_steps steps (the steps' route counts, over every rank): reported once, again
                 only after the layer has recovered

A collapse is experts that stop getting tokens: the same few take the load step after step. A single step's
busiest expert says little about that in a small run. At the start the routers' probabilities hardly differ
between tokens, so the balancing biases decide, and each step hands most of the load to another expert; and
in a few thousand tokens one frequent token (an indentation, a chat marker) is a large share of the load by
itself. In 40-step runs of 4, 8 and 16 experts at lr 0.003 a step's busiest expert reached 4 to 10 x the mean in
the first 20 steps (at times every token of the step), while the load averaged over 20 steps stayed within
1.1-1.8 x (benchmarks/expert_balance.py, docs/benchmarks.md#expert-balance). Averaging over the steps keeps what a
collapse is (the same expert, every step, its average goes to the number of experts) and drops what changes
from step to step.
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
    """Averages, per MoE layer, the expert load over the last `collapse_steps` steps and reports the layers whose
    busiest expert stands out in that average (see the module docstring)."""

    def __init__(self, settings: TrainingSettings):
        self.settings = settings
        self.average: list[list[float]] = []  # per layer, per expert: the load over the recent steps
        self.steps = 0  # steps averaged since the watch started
        self.reported: set[int] = set()  # layers reported and not recovered since

    def imbalance(self) -> list[float]:
        """Per layer, the averaged load's busiest expert over its mean expert (1 is perfect balance)."""
        return [max(layer) * len(layer) / total if (total := sum(layer)) > 0 else 1.0 for layer in self.average]

    def check(self, step: int, loads: list[list[float]]) -> Finding | None:
        """Add one step's `loads` (per layer, each expert's share of the routed tokens); an `expert_collapse`
        finding naming the layers whose averaged load has just passed `collapse_ratio`, if any."""
        s = self.settings
        horizon = max(1, s.collapse_steps)
        if [len(layer) for layer in loads] != [len(layer) for layer in self.average]:
            self.average, self.steps = [[0.0] * len(layer) for layer in loads], 0
        # the plain mean of the first `horizon` steps, then a moving average over about as many: memory that does
        # not grow with collapse_steps, and no judgement before a full window
        weight = 1.0 / min(self.steps + 1, horizon)
        for average, layer in zip(self.average, loads, strict=True):
            for expert, load in enumerate(layer):
                average[expert] += (float(load) - average[expert]) * weight
        self.steps += 1
        if self.steps < horizon:
            return None
        imbalance = self.imbalance()
        newly = []
        for layer, ratio in enumerate(imbalance):
            if ratio <= s.collapse_ratio:
                self.reported.discard(layer)
            elif layer not in self.reported:
                self.reported.add(layer)
                newly.append(layer)
        if not newly:
            return None
        worst = max(imbalance[layer] for layer in newly)
        layers = ", ".join(str(layer) for layer in newly)
        return Finding("expert_collapse", f"layer:{newly[0]}",
                       f"step {step}: experts collapsing in MoE layer{'s' if len(newly) > 1 else ''} {layers}: the "
                       f"busiest expert took more than {s.collapse_ratio:g} x the mean load over the last {horizon} "
                       f"steps ({worst:.2f} x)",
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
