"""Packed documents: a row of training tokens that holds several documents, each ended by a separator (the
dataset's eos), computed as if each document were alone.

Every layer that mixes tokens is told where documents start, through one tensor: each token's position in its
document, pos_t = t - s_t, where s_t is the first token of t's document (a row's first token starts one, as does
every token after a separator). Then, per layer (spec section 4's steps):

    RoPE                  at pos_t instead of t
    convolutions (3)      p_{t-j} reaches z_t only if j <= pos_t: the packed vectors before a document's start
                          count as the zero padding before a sequence's start
    value shift (5)       x_{t-1} reaches v_t only if pos_t >= 1
    attention (8)         t attends to s only if s_t <= s <= t   (`zaya.model.masks`: never a [T, T] mask; the
                          work follows the documents, about sum(len_i^2) / 2)

The MoE sublayer and the router's depth averaging are per token already. So a document's outputs equal those of
a forward over that document alone, up to the order of floating-point sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zaya.model.masks import DocumentLayout


class Documents(NamedTuple):
    """Packed documents as the model's layers take them: `positions` [B, T], each token's position in its
    document, on the model's device (RoPE, the convolutions' reach, the value shift); and `segments` [n, 6], the
    attention's plan (`DocumentLayout.segments`), on the host; None where a context-parallel sequence shard
    plans its attention itself. `sliding`: the plan of the sliding-window blocks (the same documents under the
    window), where the model has any."""

    positions: torch.Tensor
    segments: torch.Tensor | None
    sliding: torch.Tensor | None = None


def packed_documents(input_ids: torch.Tensor, separator: int, host_ids: torch.Tensor | None = None,
                     window: int | None = None) -> Documents:
    """`Documents` of token ids [B, T] whose documents each end with `separator`. The plan is made from
    `host_ids`, the same ids on the host (a trainer has them there before the copy to the device); without them
    it reads `input_ids` back from the device. `window`: the model's sliding window (`ZayaConfig.sliding_window`
    of a model with sliding blocks), planned for those blocks too."""
    if host_ids is not None and host_ids.shape != input_ids.shape:
        raise ValueError(f"host_ids of shape {tuple(host_ids.shape)} for input_ids of shape {tuple(input_ids.shape)}: "
                         "they must be the same ids")
    host = input_ids.cpu() if host_ids is None else host_ids
    layout = DocumentLayout.from_tokens(host, separator)
    sliding = None
    if window is not None:
        sliding = torch.from_numpy(DocumentLayout(layout.starts, layout.length, window).segments())
    return Documents(document_positions(input_ids, separator), torch.from_numpy(layout.segments()), sliding)


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
