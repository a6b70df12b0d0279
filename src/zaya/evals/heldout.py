"""`zaya eval --data`: held-out loss and perplexity of a model on a dataset split."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from zaya.data.loader import TokenLoader
from zaya.data.loss_mask import inputs_and_targets
from zaya.errors import ZayaError
from zaya.infer.loading import load_model
from zaya.model.loss import IGNORE_INDEX
from zaya.schema import shown

# Bounds on what one evaluation may ask for, checked before anything is loaded: a batch holds at most as many
# rows as a training micro-batch may (zaya.config.LIMITS) and at most 2**20 tokens (one forward pass over them
# already needs gigabytes of activations on a small model); the count of batches bounds nothing but time.
MAX_BATCH_SIZE = 2**16
MAX_BATCH_TOKENS = 2**20
MAX_BATCHES = 2**31
# lm-evaluation-harness runs (--tasks): more examples per task and more shots per prompt than any benchmark has
MAX_LIMIT = 2**24
MAX_FEWSHOT = 1024


def check_task_sizes(batch_size: int, limit: int | None, num_fewshot: int | None) -> None:
    """Refuse `--batch-size`, `--limit` and `--num-fewshot` above their bounds, before anything is loaded."""
    for flag, value, high in (("--batch-size", batch_size, MAX_BATCH_SIZE), ("--limit", limit, MAX_LIMIT),
                              ("--num-fewshot", num_fewshot, MAX_FEWSHOT)):
        if value is not None and value > high:
            raise ZayaError(f"{flag} must be at most {high:,}, got {shown(value)}")


def check_sizes(seq_len: int, batch_size: int, max_batches: int | None) -> None:
    """Refuse `--seq-len`, `--batch-size` and `--max-batches` out of their ranges, in one line naming the flag."""
    for flag, value, high in (("--seq-len", seq_len, MAX_BATCH_TOKENS), ("--batch-size", batch_size, MAX_BATCH_SIZE),
                              ("--max-batches", max_batches, MAX_BATCHES)):
        if value is None and flag == "--max-batches":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ZayaError(f"{flag} must be an integer in 1..{high:,}, got {shown(value)}")
    if seq_len * batch_size > MAX_BATCH_TOKENS:
        raise ZayaError(f"--batch-size {batch_size:,} x --seq-len {seq_len:,} is {seq_len * batch_size:,} tokens a "
                        f"batch, more than the bound {MAX_BATCH_TOKENS:,}")


def check_split(data_path: str | Path, split: str, seq_len: int, batch_size: int) -> None:
    """The dataset's `split` fills one batch of `batch_size` windows of `seq_len + 1` tokens, or one line names it,
    its tokens, what a batch needs and the fix (`zaya.train.preflight`)."""
    from zaya.data.dataset_reader import open_dataset
    from zaya.train.preflight import eval_split_problem

    problem = eval_split_problem([open_dataset(Path(data_path))], split, seq_len, batch_size)
    if problem:
        fix = "rebuild it with a larger --val-fraction, or pass" if split == "val" else "pass"
        raise ZayaError(f"{problem}: {fix} a smaller --batch-size or --seq-len")


@torch.no_grad()
def evaluate_model(model_path: str | Path, data_path: str | Path, *, split: str = "val", seq_len: int = 512,
                   batch_size: int = 8, max_batches: int | None = None, device: str | None = None,
                   record: bool = False, allow_tokenizer_change: bool = False,
                   say: Callable[[str], None] | None = None) -> dict:
    """Mean next-token cross-entropy over fixed windows of `seq_len + 1` tokens of the split (over the assistant
    tokens of a chat dataset: those its loss mask keeps).

    With `record`, a model inside a run directory also gets a "heldout" line in RUN_DIR/evals.jsonl
    (`zaya.evals.records`). The sizes are bounded (`check_sizes`), and `seq_len` by the model's
    `max_position_embeddings`. The model must carry the data's tokenizer (`zaya.tokenizer_source`) unless
    `allow_tokenizer_change`; what that check has to say goes to `say` (default: stderr)."""
    check_sizes(seq_len, batch_size, max_batches)
    if record:  # an evals.jsonl that cannot take the record is refused before the evaluation, not after it
        from zaya.evals.records import check_record_file, run_dir_of

        if (run_dir := run_dir_of(model_path)) is not None:
            check_record_file(run_dir)
    model = load_model(model_path, device=device)
    limit = model.config.max_position_embeddings
    if seq_len > limit:
        raise ZayaError(f"--seq-len {seq_len:,} is more than the model's max_position_embeddings ({limit:,})")
    from zaya.tokenizer_source import check_model_on_data

    said = check_model_on_data(model_path, data_path, allow=allow_tokenizer_change)
    if said is not None:
        (say or (lambda line: print(line, file=sys.stderr, flush=True)))(said)
    check_split(data_path, split, seq_len, batch_size)  # before the first batch, not in its place
    loader = TokenLoader([(data_path, 1.0)], seq_len, seed=0, split=split, prefetch=0)
    try:
        loader.check_vocab(model.config.vocab_size)
        device = model.embed.weight.device
        total, tokens, batches = 0.0, 0, 0
        for batch in loader.iter_eval_batches(batch_size, split=split, max_batches=max_batches):
            inputs, targets = inputs_and_targets(batch.to(device), IGNORE_INDEX)
            n = int((targets != IGNORE_INDEX).sum())
            total += float(model.loss(inputs, targets)) * n
            tokens += n
            batches += 1
    finally:
        loader.close()
    if tokens == 0:
        raise ZayaError(f"{data_path}: no evaluation batches")
    loss = total / tokens
    if record:
        from zaya.evals.records import append_record, checkpoint_step, heldout_record, run_dir_of

        run_dir = run_dir_of(model_path)
        if run_dir is not None:
            append_record(run_dir, heldout_record(model_path, checkpoint_step(model_path), split, seq_len, loss,
                                                  data=data_path, max_batches=max_batches))
    return {"model": str(model_path), "data": str(data_path), "split": split, "seq_len": seq_len,
            "batches": batches, "tokens": tokens, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}
