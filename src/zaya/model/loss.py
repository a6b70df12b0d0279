"""Next-token cross-entropy through the tied LM head, in row chunks, never materialising [N, V] logits.

With ZAYA1's 262k vocabulary a 4k-token micro-batch would need 4 GiB of fp32 logits (and as much again for
their gradient). Instead, for each chunk of rows the logits are formed, reduced to the loss, and turned
straight into the gradients of the hidden states and of the embedding matrix (the Liger-style fused
"linear + cross-entropy"), so peak memory is one chunk of logits.

    loss = mean over valid rows of  -log_softmax(h W^T)[target]
    dL/dlogits = (softmax(h W^T) - onehot(target)) / n_valid
"""

from __future__ import annotations

import torch

from zaya.device import autocast_dtype, loss_chunk_logits

IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, chunk_rows: int, matmul_dtype: torch.dtype):
        # no host read of the targets (whether all are valid): the mask is applied to the [rows, D] operands, not
        # to the [rows, V] logits' gradient, and multiplying by 1 changes no bit
        valid = targets_N != IGNORE_INDEX
        n_valid = valid.sum().clamp_min(1)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h = hidden_ND.to(matmul_dtype)
        w = weight_VD.to(matmul_dtype)
        grad_hidden = torch.empty_like(hidden_ND, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros_like(weight_VD, dtype=torch.float32) if need_weight else None
        total = hidden_ND.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            target = targets_N[rows].clamp_min(0)[:, None]
            logp = torch.log_softmax(h[rows] @ w.t(), dim=-1, dtype=torch.float32)  # one fused pass
            picked = logp.gather(1, target).squeeze(1)
            total -= (picked * valid[rows]).sum()
            if need_hidden or need_weight:
                # dL/dlogits = softmax - onehot, written straight in the matmul dtype; an invalid row's gradient
                # is zeroed through its hidden state (for the weight) and its result row (for the hidden state)
                grad = torch.exp(logp, out=torch.empty_like(logp, dtype=matmul_dtype))
                grad.scatter_add_(1, target, grad.new_full(target.shape, -1.0))
                mask = valid[rows, None].to(matmul_dtype)
                if need_hidden:
                    grad_hidden[rows] = (grad @ w) * mask
                if need_weight:
                    grad_weight.add_(grad.t() @ (h[rows] * mask))
        ctx.save_for_backward(grad_hidden, grad_weight, n_valid)
        ctx.input_dtypes = (hidden_ND.dtype, weight_VD.dtype)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        hidden_dtype, weight_dtype = ctx.input_dtypes
        out_hidden = (grad_hidden * scale).to(hidden_dtype) if grad_hidden is not None else None
        out_weight = (grad_weight * scale).to(weight_dtype) if grad_weight is not None else None
        return out_hidden, out_weight, None, None, None


def default_chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Rows per chunk, so that one chunk holds about `loss_chunk_logits(device)` logits."""
    return max(16, loss_chunk_logits(device) // vocab_size)


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    fp32_logits: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `targets` (IGNORE_INDEX rows skipped) under logits `hidden @ weight^T`.

    The matmuls run in fp32 when `fp32_logits`, else in the autocast dtype (or the inputs' dtype); the
    softmax and the loss are always fp32.
    """
    dtype = torch.float32 if fp32_logits else (autocast_dtype(hidden_ND.device) or hidden_ND.dtype)
    chunk_rows = chunk_rows or default_chunk_rows(weight_VD.shape[0], hidden_ND.device)
    with torch.autocast(hidden_ND.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, chunk_rows, dtype)
