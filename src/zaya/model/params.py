"""Parameter counts (total, active, embedding, per module), computed on the meta device: no weights allocated.

"Active" counts what one token uses: everything except the experts it was not routed to (top-1 of E).
Buffers (balancing biases) are not parameters and are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from zaya.model.config import ZayaConfig
from zaya.model.transformer import Zaya

# Component of each parameter, by the first name fragment that matches (order matters).
_COMPONENTS = [
    (".embed.", "embedding"),
    (".embed_scaling.", "residual scaling"),
    ("_residual.", "residual scaling"),
    (".moe.router.", "router"),
    (".moe.experts.", "experts"),
    (".attn.", "attention"),
    ("norm.", "norms"),
]


def _component(name: str) -> str:
    dotted = "." + name
    for fragment, component in _COMPONENTS:
        if fragment in dotted:
            return component
    return "other"


@dataclass
class ParameterReport:
    total: int
    embedding: int
    active: int  # including the embedding
    per_component: dict[str, int] = field(default_factory=dict)
    per_component_active: dict[str, int] = field(default_factory=dict)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active_non_embedding(self) -> int:
        return self.active - self.embedding

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            "embedding": self.embedding,
            "non_embedding": self.non_embedding,
            "active": self.active,
            "active_non_embedding": self.active_non_embedding,
            "per_component": dict(self.per_component),
            "per_component_active": dict(self.per_component_active),
        }

    def format(self) -> str:
        lines = [
            f"{'total':<24}{self.total:>16,}",
            f"{'  embedding (tied)':<24}{self.embedding:>16,}",
            f"{'  non-embedding':<24}{self.non_embedding:>16,}",
            f"{'active per token':<24}{self.active:>16,}",
            f"{'  active non-embedding':<24}{self.active_non_embedding:>16,}",
            "",
            f"{'component':<24}{'total':>16}{'active':>16}",
        ]
        for name, count in self.per_component.items():
            lines.append(f"{name:<24}{count:>16,}{self.per_component_active[name]:>16,}")
        return "\n".join(lines)


def parameter_report(config: ZayaConfig) -> ParameterReport:
    """Count the parameters of a model of `config` without allocating its weights."""
    with torch.device("meta"):
        model = Zaya(config)
    per_component: dict[str, int] = defaultdict(int)
    per_component_active: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        component = _component(name)
        per_component[component] += param.numel()
        # a token uses one expert of the E stacked along dim 0
        active = param.numel() // config.num_experts if component == "experts" else param.numel()
        per_component_active[component] += active
    total = sum(per_component.values())
    return ParameterReport(
        total=total,
        embedding=per_component["embedding"],
        active=sum(per_component_active.values()),
        per_component=dict(per_component),
        per_component_active=dict(per_component_active),
    )
