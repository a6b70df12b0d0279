"""How a chat dataset's loss mask travels in a batch: inside the token ids, as their sign.

A batch is [rows, seq_len + 1] int64 token ids; position t is the input of the prediction at t and the target
of the prediction at t - 1. The mask belongs to targets: a token the model must not learn to produce (a user
turn, a role header, the generation prompt, the end-of-document token) is stored as its bitwise complement
`~id = -id - 1`, which is negative, and every other token as itself. So

    ids     = where(batch < 0, ~batch, batch)            # what the model reads
    targets = where(batch < 0, IGNORE_INDEX, batch)[:, 1:]

Why in the ids rather than beside them: a batch stays one plain tensor, so everything that handles batches
without knowing about masks (the trainer's `.to(device)`, its slicing into micro-batches, `.shape`) carries
the mask along untouched, in the same one host-to-device copy; a token id is never
negative, so the encoding is lossless; a batch of unmasked data (text datasets, which count every token) is
bit for bit what it was, and decoding it changes nothing. A consumer that forgets to decode fails loudly: a
negative id is no row of the embedding.

The loss is then the mean over a micro-batch's counted targets (`IGNORE_INDEX` ones are skipped by
`zaya.model.loss`, and a context-parallel rank's share is its counted targets over the micro-batch's), so
with one micro-batch per step it is the mean over the step's assistant tokens.
"""

from __future__ import annotations

import numpy as np
import torch


def mark(rows: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Token rows (int64, changed in place) with the positions whose `mask` is 0 complemented; `mask` None
    (unmasked data) leaves them as they are."""
    if mask is not None:
        np.invert(rows, out=rows, where=mask == 0)
    return rows


def token_ids(batch: torch.Tensor) -> torch.Tensor:
    """The token ids of a (possibly masked) batch."""
    return torch.where(batch < 0, ~batch, batch)


def loss_mask(batch: torch.Tensor) -> torch.Tensor:
    """Whether each position of a batch is a token the model learns to produce (bool, the batch's shape)."""
    return batch >= 0


def inputs_and_targets(batch: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs [rows, seq_len] and next-token targets [rows, seq_len] of a batch [rows, seq_len + 1], with
    `ignore_index` at the targets the mask leaves out."""
    targets = batch[:, 1:]
    return token_ids(batch[:, :-1]), targets.masked_fill(targets < 0, ignore_index)
