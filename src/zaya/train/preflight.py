"""What a run can be refused for at its start rather than hours into it: held-out evaluations that its data cannot
feed.

A run that evaluates (`train.eval_every` > 0) takes the first `train.eval_batches` global batches of windows of
`seq_len + 1` tokens from its phase's val splits (`TokenLoader.iter_eval_batches`), and one batch at least. A val
split too small for one batch (a small corpus built with a small `--val-fraction` gets a val split of 0 tokens)
would stop the run at its first evaluation, after its first steps and before its first checkpoint; here it stops
before the first step, naming the dataset and the fix. `zaya eval --data` asks the same of the split it reads.
"""

from __future__ import annotations

from pathlib import Path

from zaya.data.dataset_reader import Dataset, open_dataset
from zaya.data.loader import num_windows
from zaya.errors import ZayaError
from zaya.train.run import ResolvedRun


def split_windows(dataset: Dataset, split: str, seq_len: int) -> tuple[int, int]:
    """(tokens, windows of `seq_len + 1` tokens) of a dataset's split, as the loader cuts them; (0, 0) for a split
    the dataset does not have."""
    entry = dataset.entries.get(split)
    tokens = 0 if entry is None else entry.num_tokens
    return tokens, num_windows(tokens, seq_len)


def eval_split_problem(datasets: list[Dataset], split: str, seq_len: int, batch: int) -> str | None:
    """What keeps `datasets`' `split` from filling one evaluation batch of `batch` windows of `seq_len + 1`
    tokens (None if nothing): the datasets, the tokens and windows they hold, and what one batch needs."""
    counts = [split_windows(dataset, split, seq_len) for dataset in datasets]
    windows = sum(w for _, w in counts)
    if windows >= batch:
        return None
    tokens = sum(t for t, _ in counts)
    names = ", ".join(str(dataset.path) for dataset in datasets)
    return (f"{names}: the {split} split has {tokens:,} tokens ({windows:,} windows of seq_len + 1 = {seq_len + 1:,} "
            f"tokens), fewer than one evaluation batch of {batch:,} windows ({batch * seq_len + 1:,} tokens)")


def check_eval_splits(run: ResolvedRun, from_phase: int = 0) -> None:
    """Every phase from `from_phase` on (those still to train) can evaluate, if the run evaluates: its val split
    fills one global batch of its windows. Else one `ZayaError` with the fix."""
    if not run.train.eval_every:
        return
    for phase in run.phases[from_phase:]:
        datasets = [open_dataset(Path(source.path)) for source in phase.sources]
        problem = eval_split_problem(datasets, "val", phase.seq_len, run.train.global_batch_size)
        if problem:
            where = f" (phase '{phase.name}')" if len(run.phases) > 1 else ""
            raise ZayaError(f"{problem}{where}: rebuild it with a larger --val-fraction, or set train.eval_every = 0 "
                            "to train without held-out evaluations")
