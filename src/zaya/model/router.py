"""The ZAYA1 router (spec section 5.1): down-projection, EDA across MoE layers, RMSNorm, a GELU MLP,
softmax over the experts plus a skip route, and balancing biases that only change the selection.

For a token x of MoE layer l:

    c_l   = W_down x + b_down
    r_l   = c_l + gamma_l * r_{l-1}        (EDA; the first MoE layer has no gamma: r_0 = c_0)
    pi    = softmax(W3 GELU(W2 GELU(W1 RMSNorm(r_l) + b1) + b2))      over E experts + 1 skip route
    i*    = argmax_i (stopgrad(pi_i) + beta_i)                        (beta: balancing biases, a buffer)
    g     = pi_{i*}                                                   (un-renormalised, keeps its gradient)

All of it runs in fp32 (fp64 in an fp64 model) whatever the model's dtype or autocast: routing decisions
are discrete, and bf16 rounding of pi flips them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zaya.model.config import ZayaConfig
from zaya.model.layers import RMSNorm


@dataclass
class Routing:
    """One MoE layer's decision for N tokens."""

    route: torch.Tensor  # [N] int64 in 0..E, where E is the skip route
    gate: torch.Tensor  # [N] fp32, the chosen route's unbiased probability (carries the router's gradient)
    probs: torch.Tensor  # [N, E + 1] fp32 softmax probabilities
    state: torch.Tensor  # [N, R] fp32 pre-norm router state r_l, passed on to the next MoE layer (EDA)


class ZayaRouter(nn.Module):
    """MLP router with exponential depth averaging and bias balancing."""

    def __init__(self, config: ZayaConfig, use_eda: bool):
        super().__init__()
        D, R, E = config.hidden_size, config.router_hidden_size, config.num_experts
        self.num_experts = E
        self.down_proj = nn.Linear(D, R, bias=True)
        # gamma of EDA; the first MoE layer has none (its key is absent from the checkpoints too)
        self.router_states_scale = nn.Parameter(torch.ones(R)) if use_eda else None
        self.norm = RMSNorm(R, config.rms_norm_eps)
        self.fc1 = nn.Linear(R, R, bias=True)
        self.fc2 = nn.Linear(R, R, bias=True)
        self.out_proj = nn.Linear(R, E + 1, bias=False)
        self.register_buffer("balancing_biases", initial_balancing_biases(E))

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would round the balancing biases, which the controller moves in small steps.
        super()._apply(fn, recurse)
        self.balancing_biases.data = self.balancing_biases.data.float()
        return self

    def forward(self, x_ND: torch.Tensor, prev_state: torch.Tensor | None) -> Routing:
        with torch.autocast(x_ND.device.type, enabled=False):
            c = _linear32(_fp32(x_ND), self.down_proj)
            if self.router_states_scale is not None and prev_state is not None:
                r = c + prev_state * _fp32(self.router_states_scale)
            else:
                r = c
            h = F.rms_norm(r, self.norm.weight.shape, _fp32(self.norm.weight), self.norm.eps)
            h = F.gelu(_linear32(h, self.fc1))
            h = F.gelu(_linear32(h, self.fc2))
            logits = _linear32(h, self.out_proj)
            probs = torch.softmax(logits, dim=-1)
            route = torch.argmax(probs.detach() + self.balancing_biases, dim=-1)
            # indexed, not a squeezed view of a gather: a sharded router's outputs carry FSDP's backward hooks
            gate = probs[torch.arange(route.numel(), device=route.device), route]
        return Routing(route=route, gate=gate, probs=probs, state=r)


def initial_balancing_biases(num_experts: int) -> torch.Tensor:
    """beta = 0 for the experts and -1 for the skip route, which then can never win (pi_skip - 1 <= 0)."""
    biases = torch.zeros(num_experts + 1, dtype=torch.float32)
    biases[-1] = -1.0
    return biases


def _linear32(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, _fp32(layer.weight), None if layer.bias is None else _fp32(layer.bias))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """At least fp32: an fp64 model (the exactness tests) routes in fp64."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
