"""Model helpers shared by tests, importable from spawned processes too (a conftest is not, reliably: each
test directory has its own)."""

from __future__ import annotations

import torch


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add noise to every parameter, so residual scales, biases, EDA gammas and temperatures all matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model
