"""Muon for the model's matrices, AdamW for everything else, as one optimizer.

The split follows the groups the model declares (`zaya.model.groups`), by their role:

    Muon    the hidden matrices: every nn.Linear weight inside a block (attention q/k/v_cur/v_del/o projections
            and the router's down/fc1/fc2/out matrices) and both stacked expert tensors (each of the E
            matrices on its own)
    AdamW   the tied embedding (also the LM head) and the convolution weights, with weight decay;
            norms, biases, residual scales and biases, the embedding affine, EDA gammas and key
            temperatures, without weight decay unless `decay_vectors` is set, at `vector_lr_ratio` (0.03) of
            AdamW's rate

With `adjust_lr_fn="match_rms_adamw"` Muon's updates have AdamW's RMS, so both take the same learning
rate and one schedule: each param group keeps its configured rate as `initial_lr`, and the trainer sets
`lr = initial_lr * multiplier(step)` on every group (`zaya.optim.schedule.set_lr_multiplier`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adam import adam

from zaya.errors import ZayaError
from zaya.optim.config import OptimConfig, finite_number, positive_number
from zaya.optim.muon import dtype_name, muon_defaults, muon_step, run_closure, validate_muon_group
from zaya.optim.ns_iteration import Workspace
from zaya.parallel.comm import CommCounter
from zaya.parallel.dtensor import local

ALGORITHMS = ("muon", "adamw")


# ---- the split --------------------------------------------------------------------------------------


@dataclass
class ParamGroupSpec:
    """One param group of the split: its name ("muon/attention", ...), algorithm and members."""

    name: str
    algorithm: str
    decay: bool  # weight decay applies (always for matrices; for vectors when `decay_vectors`)
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    role: str = "other"  # the model's role of its members (`zaya.model.groups`): matrix, weight, vector

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def matrices(self) -> int:
        """Matrices Muon orthogonalises: one per 2-D parameter, E per stacked [E, m, n] parameter."""
        return sum(p.shape[0] if p.ndim == 3 else 1 for p in self.params)


# Each role the model gives its groups (`zaya.model.groups`): the algorithm, and whether weight decay applies
# always (matrices, the embedding, convolutions) or only with `decay_vectors`.
ROLE_ALGORITHMS = {"matrix": ("muon", True), "weight": ("adamw", True), "vector": ("adamw", False)}


def split_parameters(model: nn.Module, decay_vectors: bool = False) -> list[ParamGroupSpec]:
    """The param groups of the parameter groups `model` declares (`parameter_groups()`, as `zaya.model` does),
    in their order, each named after its algorithm and group ("muon/attention", "adamw/norms", ...). A module
    that declares none is one group, "adamw/other"."""
    declare = getattr(model, "parameter_groups", None)
    if declare is None:  # named_parameters gives a tied parameter once, under its first name
        named = list(model.named_parameters())
        return [ParamGroupSpec("adamw/other", "adamw", decay_vectors, [name for name, _ in named],
                               [param for _, param in named])] if named else []
    specs = []
    for group in declare():
        algorithm, decay = ROLE_ALGORITHMS[group.role]
        specs.append(ParamGroupSpec(f"{algorithm}/{group.name}", algorithm, decay or decay_vectors,
                                    list(group.names), list(group.params), group.role))
    return specs


# ---- the optimizer ----------------------------------------------------------------------------------


def adamw_defaults(
    lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0
) -> dict[str, Any]:
    """The hyperparameters of an AdamW param group, as stored in it."""
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}


class MuonAdamW(Optimizer):
    """One optimizer over param groups tagged `algorithm="muon"` or `algorithm="adamw"`.

    Muon groups carry Muon's hyperparameters (see `zaya.optim.muon.Muon`) and are stepped together, so
    same-shape matrices of different groups share their Newton-Schulz batches; AdamW groups carry `lr`,
    `betas`, `eps`, `weight_decay` and are stepped with `torch.optim.AdamW`'s own functional code (state
    `step`, `exp_avg`, `exp_avg_sq`, as torch keeps it). Missing hyperparameters take the defaults of
    `muon_defaults` / `adamw_defaults`. Every group also keeps `initial_lr`, its configured rate.

    Parameters may be FSDP2 `DTensor`s: AdamW and Muon's momentum run on the local shards, and Muon's split
    matrices go to their owner ranks (`zaya.optim.distributed`), whose traffic `comm` counts. After each step
    `last_muon_report` says what this rank orthogonalised.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], comm: CommCounter | None = None) -> None:
        super().__init__(list(param_groups), defaults={})
        self._workspace = Workspace()
        self.comm = comm
        self.last_muon_report = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._workspace = Workspace()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm")
        if algorithm not in ALGORITHMS:
            raise ZayaError(f"MuonAdamW: param group 'algorithm' must be one of {', '.join(ALGORITHMS)}, "
                            f"got {algorithm!r}")
        defaults = muon_defaults() if algorithm == "muon" else adamw_defaults()
        for key, value in defaults.items():
            param_group.setdefault(key, value)
        if algorithm == "muon":
            param_group["ns_dtype"] = dtype_name(param_group["ns_dtype"])
        param_group.setdefault("initial_lr", param_group["lr"])
        param_group.setdefault("name", algorithm)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"MuonAdamW group '{group['name']}'"
        if algorithm == "muon":
            validate_muon_group(group, where)
        else:
            _validate_adamw_group(group, where)

    @torch.no_grad()
    def init_state(self) -> None:
        """Give every parameter the state its first step would (zero moments, step 0), without a step: what a
        checkpoint is then loaded into. (torch's state-dict API otherwise runs a step with zero gradients,
        which for Muon is a whole Newton-Schulz pass.)"""
        for group in self.param_groups:
            for param in group["params"]:
                if not self.state[param]:
                    if group["algorithm"] == "muon":
                        zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
                        self.state[param]["momentum_buffer"] = zeros
                    else:
                        self.state[param].update(_adamw_state(param))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every group; returns the closure's loss, if given."""
        loss = run_closure(closure)
        muon_groups = [g for g in self.param_groups if g["algorithm"] == "muon"]
        self.last_muon_report = muon_step(muon_groups, self.state, self._workspace, self.comm)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                _adamw_step(group, self.state)
        return loss


def _validate_adamw_group(group: MutableMapping[str, Any], where: str) -> None:
    for name in ("lr", "weight_decay"):
        if not finite_number(group[name]) or group[name] < 0:
            raise ZayaError(f"{where}: '{name}' must be a non-negative number, got {group[name]!r}")
    if not positive_number(group["eps"]):
        raise ZayaError(f"{where}: 'eps' must be a positive number, got {group['eps']!r}")
    betas = group["betas"]
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(finite_number(b) and 0 <= b < 1 for b in betas)):
        raise ZayaError(f"{where}: 'betas' must be two numbers in [0, 1), got {betas!r}")


def _adamw_step(group: MutableMapping[str, Any], state: MutableMapping[Tensor, dict[str, Any]]) -> None:
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise ZayaError("AdamW: sparse gradients are not supported")
        param_state = state[param]
        if not param_state:
            param_state.update(_adamw_state(param))
        # elementwise: a DTensor's step is its local shard's
        params.append(local(param))
        grads.append(local(param.grad))
        exp_avgs.append(local(param_state["exp_avg"]))
        exp_avg_sqs.append(local(param_state["exp_avg_sq"]))
        steps.append(param_state["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        foreach=None, capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
        has_complex=any(torch.is_complex(p) for p in params), decoupled_weight_decay=True,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=False,
    )  # fmt: skip


def _adamw_state(param: Tensor) -> dict[str, Tensor]:
    # torch.optim.AdamW's state layout, so either can resume from the other's state dict
    return {"step": torch.tensor(0.0, dtype=_scalar_dtype()),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def _scalar_dtype() -> torch.dtype:
    # the dtype torch.optim gives its step counters
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def build_optimizer(model: nn.Module, config: OptimConfig | None = None, comm: CommCounter | None = None) -> MuonAdamW:
    """Muon + AdamW over all of `model`'s parameters, split by `split_parameters`; one group per split group
    (named as in `describe_param_groups`), each with `initial_lr` set for the schedule. `comm` counts the
    optimizer's collectives when the parameters are sharded."""
    config = config or OptimConfig()
    groups = []
    for spec in split_parameters(model, config.decay_vectors):
        weight_decay = config.weight_decay if spec.decay else 0.0
        if spec.algorithm == "muon":
            hyper = muon_defaults(
                lr=config.lr, weight_decay=weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                ns_coefficients=config.ns_coefficients, eps=config.ns_eps, ns_steps=config.ns_steps,
                adjust_lr_fn=config.adjust_lr_fn, ns_dtype=config.ns_dtype, ns_backend=config.ns_backend,
            )  # fmt: skip
        else:
            hyper = adamw_defaults(config.rate("adamw", spec.role), config.adamw_betas, config.adamw_eps,
                                   weight_decay)
        groups.append(
            {"params": spec.params, "name": spec.name, "algorithm": spec.algorithm, **hyper, "initial_lr": hyper["lr"]}
        )
    return MuonAdamW(groups, comm)


def describe_param_groups(model: nn.Module, config: OptimConfig | None = None) -> str:
    """A table of the split: group, algorithm, learning rate, weight decay, tensors, matrices (Muon), parameters
    and the distinct parameter names (layer and expert indices as *); its total is the model's parameter count."""
    config = config or OptimConfig()
    specs = split_parameters(model, config.decay_vectors)
    header = f"{'group':<24}{'algorithm':<10}{'lr':>9}{'wd':>6}{'tensors':>9}{'matrices':>10}{'parameters':>16}  names"
    lines = [header, "-" * len(header)]
    for spec in specs:
        lr = config.rate(spec.algorithm, spec.role)
        wd = config.weight_decay if spec.decay else 0.0
        matrices = f"{spec.matrices:,}" if spec.algorithm == "muon" else "-"
        lines.append(
            f"{spec.name:<24}{spec.algorithm:<10}{lr:>9.2e}{wd:>6g}{len(spec.params):>9,}{matrices:>10}"
            f"{spec.numel:>16,}  {_name_patterns(spec.names)}"
        )
    lines.append("-" * len(header))
    tensors = sum(len(spec.params) for spec in specs)
    total = sum(spec.numel for spec in specs)
    lines.append(f"{'total':<49}{tensors:>9,}{'':>10}{total:>16,}")
    return "\n".join(lines)


def _name_patterns(names: list[str], limit: int = 4) -> str:
    patterns = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))
    shown = ", ".join(patterns[:limit])
    return shown + (f", +{len(patterns) - limit} more" if len(patterns) > limit else "")
