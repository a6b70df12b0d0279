"""`zaya eval --data`: held-out loss and perplexity of a model on a dataset split."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zaya.data.loader import TokenLoader
from zaya.data.loss_mask import inputs_and_targets
from zaya.errors import ZayaError
from zaya.infer.loading import load_model
from zaya.model.loss import IGNORE_INDEX


@torch.no_grad()
def evaluate_model(model_path: str | Path, data_path: str | Path, *, split: str = "val", seq_len: int = 512,
                   batch_size: int = 8, max_batches: int | None = None, device: str | None = None,
                   record: bool = False) -> dict:
    """Mean next-token cross-entropy over fixed windows of `seq_len + 1` tokens of the split (over the assistant
    tokens of a chat dataset: those its loss mask keeps).

    With `record`, a model inside a run directory also gets a "heldout" line in RUN_DIR/evals.jsonl
    (`zaya.evals.records`)."""
    model = load_model(model_path, device=device)
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
            append_record(run_dir, heldout_record(model_path, checkpoint_step(model_path), split, seq_len, loss))
    return {"model": str(model_path), "data": str(data_path), "split": split, "seq_len": seq_len,
            "batches": batches, "tokens": tokens, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}
