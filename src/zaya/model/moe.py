"""Dropless top-1 Mixture of Experts with SwiGLU experts stored stacked (spec section 5.2).

    Expert_e(x) = W_down,e ( SiLU(W_gate,e x) * (W_up,e x) ),   gate_up_proj[e] = [W_gate,e ; W_up,e]
    m = g * Expert_{i*}(x)                  if i* < E
    m = 0  (native)  or  g * x  (legacy)    if i* = E, the skip route

Dispatch sorts the tokens by expert and runs each projection as one grouped matmul over contiguous row
ranges (`torch._grouped_mm` where it exists, else one padded batched matmul), so no Python loop issues a
matmul per expert and nothing waits on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zaya.device import autocast_dtype, grouped_mm_pays_for_empty_groups
from zaya.model.config import ZayaConfig
from zaya.model.router import Routing, ZayaRouter

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


class Experts(nn.Module):
    """E SwiGLU experts as two stacked tensors: `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        E, F_, D = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))
        self.use_grouped_mm = HAS_GROUPED_MM

    def forward(self, x_ND: torch.Tensor, expert_N: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
        """sum over tokens of weight * Expert_{expert}(x); `expert` must lie in 0..E-1."""
        if x_ND.shape[0] < self.num_experts and grouped_mm_pays_for_empty_groups(x_ND.device):
            if x_ND.shape[0] == 1:
                return self._single(x_ND, expert_N, weight_N)
            return self.gathered(x_ND, expert_N, weight_N)
        order = torch.argsort(expert_N, stable=True)
        counts = torch.bincount(expert_N, minlength=self.num_experts)
        # cast before permuting: under autocast the experts run in bf16, and half the bytes move
        x_sorted = _permute_rows(x_ND.to(autocast_dtype(x_ND.device) or x_ND.dtype), order)
        matmul = _grouped_matmul if self.use_grouped_mm else _padded_matmul
        h = matmul(x_sorted, self.gate_up_proj, counts)
        gate, up = h.chunk(2, dim=-1)
        y_sorted = matmul(F.silu(gate) * up, self.down_proj, counts)
        y_sorted = y_sorted * weight_N[order, None].to(y_sorted.dtype)
        return _permute_rows(y_sorted, torch.argsort(order))

    def gathered(self, x_ND: torch.Tensor, expert_N: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
        """The same sum for few tokens (decoding): each token's expert weights gathered, one batched matmul per
        projection, and no host sync (the compiled decode step uses it as it is)."""
        x = x_ND[:, :, None]
        gate_up = self.gate_up_proj.index_select(0, expert_N)
        x, gate_up = _autocast_operands(x, gate_up)
        gate, up = torch.bmm(gate_up, x).chunk(2, dim=1)
        down = self.down_proj.index_select(0, expert_N).to(x.dtype)
        y = torch.bmm(down, F.silu(gate) * up).squeeze(-1)
        return y * weight_N[:, None].to(y.dtype)

    def _single(self, x_ND: torch.Tensor, expert_N: torch.Tensor, weight_N: torch.Tensor) -> torch.Tensor:
        """One token, one expert: its weights read in place (the index is in host memory on the CPU)."""
        e = int(expert_N[0])
        x, gate_up = _autocast_operands(x_ND, self.gate_up_proj[e])
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, self.down_proj[e].to(x.dtype))
        return y * weight_N[:, None].to(y.dtype)


class ZayaMoE(nn.Module):
    """Router + experts. The skip route computes nothing; its output follows `config.skip_route`."""

    def __init__(self, config: ZayaConfig, use_eda: bool):
        super().__init__()
        self.num_experts = config.num_experts
        self.skip_identity = config.skip_route == "identity"
        self.router = ZayaRouter(config, use_eda)
        self.experts = Experts(config)

    def forward(
        self, x_BTD: torch.Tensor, prev_router_state: torch.Tensor | None, *, gathered: bool = False
    ) -> tuple[torch.Tensor, Routing]:
        """MoE output [B, T, D] and the routing; `gathered` always takes `Experts.gathered` (decoding)."""
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D)
        routing = self.router(x, prev_router_state)
        skipped = routing.route == self.num_experts
        # Skipped tokens ride along with the last expert at weight 0: it keeps the dispatch free of host syncs,
        # and the skip route is (by its bias of -1) practically never taken.
        expert = routing.route.clamp(max=self.num_experts - 1)
        weight = routing.gate.masked_fill(skipped, 0.0)
        out = self.experts.gathered(x, expert, weight) if gathered else self.experts(x, expert, weight)
        if self.skip_identity:
            out = out + ((routing.gate * skipped)[:, None] * x).to(out.dtype)
        return out.view(B, T, D), routing


# ---- dispatch primitives ------------------------------------------------------------------------------


class _PermuteRows(torch.autograd.Function):
    """x[perm] whose backward is the inverse gather rather than a scatter-add (perm is a permutation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(perm)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (perm,) = ctx.saved_tensors
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return grad.index_select(0, inverse), None


def _permute_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return _PermuteRows.apply(x, perm)


class _GroupedMM(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e]^T over contiguous row groups, forward and backward grouped."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_EMK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_NK, w_EMK, offsets)
        return torch._grouped_mm(x_NK, w_EMK.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor):
        x_NK, w_EMK, offsets = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()  # the kernel rejects broadcast (zero-stride) gradients
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_NM, w_EMK, offs=offsets)
        if ctx.needs_input_grad[1]:
            # per group: dW_e = dY_e^T X_e, a grouped matmul whose groups split the shared (token) dimension
            grad_w = torch._grouped_mm(grad_NM.t(), x_NK, offs=offsets)
        return grad_x, grad_w, None


def _autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Autocast does not cover grouped matmuls: cast as it would cast an nn.Linear.
    dtype = autocast_dtype(x.device)
    if dtype is not None:
        return x.to(dtype), w.to(dtype)
    return x, w.to(x.dtype)


def _grouped_matmul(x_NK: torch.Tensor, w_EMK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    x_NK, w_EMK = _autocast_operands(x_NK, w_EMK)
    offsets = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return _GroupedMM.apply(x_NK, w_EMK, offsets)


def _padded_matmul(x_NK: torch.Tensor, w_EMK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Fallback without `torch._grouped_mm`: scatter the sorted rows into [E, capacity, K], one bmm, gather back."""
    x_NK, w_EMK = _autocast_operands(x_NK, w_EMK)
    E, N = counts_E.numel(), x_NK.shape[0]
    starts = torch.cumsum(counts_E, 0) - counts_E
    expert = torch.repeat_interleave(torch.arange(E, device=x_NK.device), counts_E, output_size=N)
    slot = torch.arange(N, device=x_NK.device) - starts[expert]
    capacity = int(counts_E.max()) if N else 0
    padded = x_NK.new_zeros(E, capacity, x_NK.shape[1])
    padded = padded.index_put((expert, slot), x_NK)
    out = torch.bmm(padded, w_EMK.transpose(-2, -1))
    return out[expert, slot]
