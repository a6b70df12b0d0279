"""Packed documents: a row of training tokens that holds several documents, each ended by a separator (the
dataset's eos), computed as if each document were alone.

Every layer that mixes tokens is told where documents start, through one tensor: each token's position in its
document, pos_t = t - s_t, where s_t is the first token of t's document (a row's first token starts one, as does
every token after a separator). Then, per layer (spec section 4's steps):

    RoPE                  at pos_t instead of t
    convolutions (3)      p_{t-j} reaches z_t only if j <= pos_t: the packed vectors before a document's start
                          count as the zero padding before a sequence's start
    value shift (5)       x_{t-1} reaches v_t only if pos_t >= 1
    attention (8)         t attends to s only if s_t <= s <= t

The MoE sublayer and the router's depth averaging are per token already. So a document's outputs equal those of
a forward over that document alone, up to the order of floating-point sums.
"""

from __future__ import annotations

import torch


def document_positions(input_ids: torch.Tensor, separator: int) -> torch.Tensor:
    """Each token's position in its document [B, T] (int64), for token ids [B, T] whose documents each end with
    `separator`: the token after a separator starts a document. Computed on the device, without host reads."""
    T = input_ids.shape[1]
    t = torch.arange(T, device=input_ids.device)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == separator
    starts[:, 0] = True
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - first


def attention_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query t may attend to key s (causal, inside t's document), from `document_positions`."""
    t = torch.arange(positions.shape[1], device=positions.device)
    first = t - positions  # [B, T]: where each query's document starts
    return ((t[None, None, :] >= first[:, :, None]) & (t[None, None, :] <= t[None, :, None]))[:, None]
