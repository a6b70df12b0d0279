"""The model's parameters in the groups an optimizer treats alike, declared by the model (by module type and
attribute, never by a parameter's qualified name), so that an optimizer needs no knowledge of its classes.

Each group has a role:

    matrix   a hidden 2-D weight, or a stack of them: every nn.Linear weight inside a block (attention
             q/k/v_cur/v_del/o projections, the router's down/fc1/fc2/out matrices) and both stacked expert
             tensors (each of the E matrices on its own)
    weight   a weight that is no hidden matrix and still decays: the tied embedding (also the LM head) and the
             convolution weights
    vector   norms, biases, residual scales and biases, the embedding affine, EDA gammas, key temperatures

in this order, which is the optimizer's order of param groups (and so of its state dict).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import Tensor, nn

from zaya.model.attention import CompressedConvAttention
from zaya.model.layers import EmbeddingScaling, ResidualScaling, RMSNorm
from zaya.model.moe import Experts
from zaya.model.router import ZayaRouter

# each group and its role: "matrix" (a 2-D weight for Muon), "weight" (AdamW, decayed), "vector" (AdamW)
GROUPS = {
    "attention": "matrix",
    "router": "matrix",
    "experts": "matrix",
    "block-matrices": "matrix",
    "embedding": "weight",
    "convolutions": "weight",
    "norms": "vector",
    "biases": "vector",
    "residual-scaling": "vector",
    "eda-gammas": "vector",
    "temperatures": "vector",
    "other": "vector",
}
_ATTENTION_ATTRIBUTES = {
    "conv0_weight": "convolutions",
    "conv1_weight": "convolutions",
    "conv0_bias": "biases",
    "conv1_bias": "biases",
    "temp": "temperatures",
}


@dataclass
class ParameterGroup:
    """One group: its name, its role, and its members with their qualified names."""

    name: str
    role: str
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def parameter_groups(model: nn.Module, block_type: type[nn.Module]) -> list[ParameterGroup]:
    """`model`'s parameters in the groups above (empty groups left out), each parameter once (a tied weight under
    its first name), in model order within a group. `block_type` is the class of a decoder block: a matrix
    inside one is a hidden matrix, a matrix outside the blocks is not."""
    groups = {name: ParameterGroup(name, role) for name, role in GROUPS.items()}
    seen: set[int] = set()
    for name, group, param in _walk(model, block_type):
        if id(param) not in seen:
            seen.add(id(param))
            groups[group].names.append(name)
            groups[group].params.append(param)
    return [group for group in groups.values() if group.params]


def _group_of(module: nn.Module, attribute: str, context: str | None) -> str:
    """The group of `module.<attribute>`; `context` is the nearest enclosing block, attention or router."""
    if isinstance(module, Experts):
        return "experts"
    if isinstance(module, nn.Linear):
        if attribute == "bias":
            return "biases"
        if context is None:  # a matrix outside the blocks
            return "other"
        return {"attention": "attention", "router": "router"}.get(context, "block-matrices")
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, RMSNorm):
        return "norms"
    if isinstance(module, (ResidualScaling, EmbeddingScaling)):
        return "residual-scaling"
    if isinstance(module, ZayaRouter) and attribute == "router_states_scale":
        return "eda-gammas"
    if isinstance(module, CompressedConvAttention) and attribute in _ATTENTION_ATTRIBUTES:
        return _ATTENTION_ATTRIBUTES[attribute]
    return "other"


def _walk(module: nn.Module, block_type: type[nn.Module], prefix: str = "",
          context: str | None = None) -> Iterator[tuple[str, str, Tensor]]:
    """(qualified name, group, parameter) for every parameter registered under `module`."""
    for attribute, param in module.named_parameters(recurse=False):
        yield prefix + attribute, _group_of(module, attribute, context), param
    for child_name, child in module.named_children():
        child_context = context
        if isinstance(child, CompressedConvAttention):
            child_context = "attention"
        elif isinstance(child, ZayaRouter):
            child_context = "router"
        elif isinstance(child, block_type):
            child_context = "block"
        yield from _walk(child, block_type, f"{prefix}{child_name}.", child_context)
