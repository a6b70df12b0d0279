"""The balancing-bias controller (spec section 5.3): a PID controller per MoE layer on the expert load.

After every optimizer step, from the global batch's routing counts n_{l,i} of layer l:

    f_i = n_i / N                       load fraction of expert i (the skip route excluded)
    e_i = 1/E - f_i                     error: positive for an under-loaded expert
    beta_i <- beta_i^0 + kp e_i + ki sum_{tau<=t} u(e_i(tau)) + kd (e_i(t) - e_i(t-1))

with u(e) = e ("linear") or sign(e) ("sign"). Then the E expert biases are re-centred to zero mean; the skip
route's bias stays where it is (-1). With kp = kd = 0 and u = sign this is DeepSeek-V3's loss-free balancing,
beta_i += ki * sign(e_i). The biases only change which expert is chosen, never the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ControllerState:
    """Everything the controller remembers between steps (saved in every checkpoint)."""

    base: torch.Tensor  # [L, E] beta^0: the biases when the controller started
    integral: torch.Tensor  # [L, E] the running sum of u(e)
    previous_error: torch.Tensor  # [L, E] e(t-1)
    steps: int = 0

    def state_dict(self) -> dict:
        return {"base": self.base, "integral": self.integral, "previous_error": self.previous_error,
                "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.base.copy_(state["base"])
        self.integral.copy_(state["integral"])
        self.previous_error.copy_(state["previous_error"])
        self.steps = int(state["steps"])


class BalanceController:
    """Moves each router's `balancing_biases` towards equal expert load."""

    def __init__(self, routers: list[torch.nn.Module], kp: float, ki: float, kd: float, error: str = "linear"):
        if error not in ("linear", "sign"):
            raise ValueError(f"error must be 'linear' or 'sign', got {error!r}")
        self.routers = routers
        self.kp, self.ki, self.kd, self.error = kp, ki, kd, error
        num_experts = routers[0].num_experts
        base = torch.stack([r.balancing_biases[:num_experts].detach().clone().float().cpu() for r in routers])
        self.state = ControllerState(base=base, integral=torch.zeros_like(base), previous_error=torch.zeros_like(base))

    @torch.no_grad()
    def update(self, counts: torch.Tensor) -> torch.Tensor:
        """Update every router's biases from route counts [L, E + 1] of the last step; returns the error [L, E]."""
        num_experts = self.state.base.shape[1]
        expert_counts = counts[:, :num_experts].double().cpu()
        load = expert_counts / expert_counts.sum(dim=1, keepdim=True).clamp_min(1)
        error = (1.0 / num_experts - load).float()
        drive = torch.sign(error) if self.error == "sign" else error
        self.state.integral += drive
        derivative = error - self.state.previous_error if self.state.steps else torch.zeros_like(error)
        biases = self.state.base + self.kp * error + self.ki * self.state.integral + self.kd * derivative
        biases -= biases.mean(dim=1, keepdim=True)
        device = biases.to(self.routers[0].balancing_biases, non_blocking=True)  # one copy to the device
        for router, row in zip(self.routers, device, strict=True):
            router.balancing_biases[:num_experts] = row
        self.state.previous_error = error
        self.state.steps += 1
        return error


def load_imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Per layer, the busiest expert's load over the mean load (1 is perfect balance); counts [L, E + 1]."""
    experts = counts[:, :-1].double()
    return experts.max(dim=1).values / experts.mean(dim=1).clamp_min(1e-9)
