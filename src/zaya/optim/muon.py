"""Muon for the matrices of the model: momentum, then an update orthogonalised by Newton-Schulz.

For a matrix parameter W [m, n] with gradient g, step t (the semantics of `torch.optim.Muon`):

    B_t = mu B_{t-1} + (1 - mu) g_t                         momentum, kept as an EMA (B_0 = 0)
    U_t = (1 - mu) g_t + mu B_t   if nesterov,  else B_t
    O_t = NS_k(U_t)                                         quintic Newton-Schulz, k = 5 steps
    W_t = (1 - lr lambda) W_{t-1} - lr s(m, n) O_t          decoupled weight decay, update-RMS rule s

    s(m, n) = sqrt(max(1, m / n))          "original" (Keller Jordan's Muon)
    s(m, n) = 0.2 sqrt(max(m, n))          "match_rms_adamw" (Moonshot): the update's RMS matches AdamW's,
                                            so one learning rate and schedule serve both optimizers

The orthogonalisation itself, batched over every matrix of one shape, is `zaya.optim.ns_iteration`.
Parameters may be `DTensor`s (FSDP2 shards): the momentum runs on each rank's shard; a shard that holds whole
matrices (a stack of experts split along the expert dimension, or any parameter on one rank) is
orthogonalised where it lies, and every other matrix by one owner rank (`zaya.optim.distributed`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from zaya.errors import ZayaError
from zaya.optim.config import ADJUST_LR_FNS, NS_COEFFICIENTS, NS_EPS, NS_STEPS
from zaya.optim.distributed import MatrixLayout, MuonReport, SplitMatrices, owner_step
from zaya.optim.ns_iteration import (
    NS_DTYPES,
    Batch,
    Workspace,
    as_stack,
    check_ns_settings,
    cpu_slices,
    finite,
    normalize_into,
    run_batches,
)
from zaya.parallel.dtensor import is_dtensor, local, shard_layout

if TYPE_CHECKING:
    from zaya.parallel.comm import CommCounter



def muon_update(
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> list[Tensor]:
    """Muon's update directions for full local matrices (each [m, n] or a stack [E, m, n]): the momentum
    B <- lerp(B, g, 1 - mu), in place, then O = NS(U) with U = lerp(g, B, mu) (Nesterov) or B, batched by shape.

    Returns O per input, of its shape, in `dtype`; the caller applies W <- (1 - lr wd) W - lr s(m, n) O
    (`adjusted_lr`). This is the part of a Muon step that needs whole matrices, for an optimizer that
    gathers them on the rank that owns them.
    """
    check_ns_settings(steps, coefficients, eps, backend)
    if len(grads) != len(momentum_buffers):
        raise ZayaError(f"muon_update: {len(grads)} gradients but {len(momentum_buffers)} momentum buffers")
    directions = [_Direction(g, b, momentum, nesterov) for g, b in zip(grads, momentum_buffers, strict=True)]
    return run_batches(directions, "muon_update", steps, coefficients, eps, dtype, backend)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The learning rate of a [rows, cols] matrix under the update-RMS rule `adjust_lr_fn` (None: "original")."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ZayaError(f"Muon: 'adjust_lr_fn' must be one of {', '.join(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")
    return lr * ratio


def _value(number: Any) -> Any:
    """A one-element tensor (torch's optimizers take `lr` as one) as a Python number; anything else as is."""
    return number.item() if isinstance(number, Tensor) and number.numel() == 1 else number


@dataclass
class _Direction:
    """The momentum and update direction of one tensor of matrices ([m, n] or a stack [E, m, n])."""

    grad: Tensor
    buffer: Tensor
    momentum: float
    nesterov: bool

    @property
    def shape(self) -> torch.Size:
        return self.grad.shape

    @property
    def device(self) -> torch.device:
        return self.grad.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        """B <- lerp(B, g, 1 - mu); out = U / max(||U||_F, eps) per matrix, U = lerp(g, B, mu) (Nesterov) or B,
        normalised in fp32 (or the gradient's precision, if finer) before the one rounding to out's dtype."""
        stacks = as_stack(self.grad)[start:stop], as_stack(self.buffer)[start:stop], out_BMN
        for grad, buffer, out in cpu_slices(*stacks):
            buffer.lerp_(grad, 1 - self.momentum)
            if self.nesterov:
                scratch = workspace.take("U", grad.shape, grad.dtype, grad.device)
                update = torch.lerp(grad, buffer, self.momentum, out=scratch)
                normalize_into(update, out, eps, overwrite=True)
            else:
                normalize_into(buffer, out, eps)


# ---- the optimizer --------------------------------------------------------------------------------------


def muon_defaults(
    lr: float | Tensor = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype | str = torch.bfloat16,
    ns_backend: str = "auto",
) -> dict[str, Any]:
    """The hyperparameters of a Muon param group as stored in it: `ns_dtype` by name, so that a state dict
    holds only tensors, numbers and strings."""
    return {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "nesterov": nesterov,
        "ns_coefficients": tuple(ns_coefficients) if isinstance(ns_coefficients, list) else ns_coefficients,
        "eps": eps,
        "ns_steps": ns_steps,
        "adjust_lr_fn": adjust_lr_fn,
        "ns_dtype": dtype_name(ns_dtype),
        "ns_backend": ns_backend,
    }


def validate_muon_group(group: MutableMapping[str, Any], where: str = "Muon") -> None:
    """Raise `ZayaError` naming the first hyperparameter or parameter of a Muon group that is unusable."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and (lr.numel() != 1 or not lr.is_floating_point()):
        raise ZayaError(
            f"{where}: a tensor 'lr' must hold one real floating-point number, got shape {list(lr.shape)} "
            f"and dtype {lr.dtype}"
        )
    for name, value in (("lr", _value(lr)), ("weight_decay", group["weight_decay"])):
        if not finite(value) or value < 0:
            raise ZayaError(f"{where}: '{name}' must be a non-negative number, got {group[name]!r}")
    if not finite(group["momentum"]) or not 0 <= group["momentum"] < 1:
        raise ZayaError(f"{where}: 'momentum' must be in [0, 1), got {group['momentum']!r}")
    if not isinstance(group["nesterov"], bool):
        raise ZayaError(f"{where}: 'nesterov' must be true or false, got {group['nesterov']!r}")
    check_ns_settings(group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_backend"], where)
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ZayaError(
            f"{where}: 'adjust_lr_fn' must be one of {', '.join(ADJUST_LR_FNS)}, got {group['adjust_lr_fn']!r}"
        )
    if group["ns_dtype"] not in NS_DTYPES:
        raise ZayaError(f"{where}: 'ns_dtype' must be one of {', '.join(NS_DTYPES)}, got {group['ns_dtype']!r}")
    for param in group["params"]:
        if param.ndim not in (2, 3) or torch.is_complex(param):
            raise ZayaError(
                f"{where}: a parameter of shape {list(param.shape)} and dtype {param.dtype} is neither a real "
                "matrix [m, n] nor a stack of matrices [E, m, n]; optimise it with AdamW"
            )


class Muon(Optimizer):
    """Muon (momentum orthogonalised by Newton-Schulz) with the constructor and semantics of
    `torch.optim.Muon`, plus stacked expert parameters [E, m, n] (each of the E matrices orthogonalised on
    its own, under the learning-rate rule of one [m, n] matrix) and batched Newton-Schulz.

    `lr` may be a one-element tensor, as torch's optimizers allow; its value is read at every step. Beyond
    torch's arguments: `ns_dtype` (torch.bfloat16 or torch.float32, or their names) is the precision
    of the iteration; `ns_backend` is "eager", "compiled" or "auto" (compiled on GPUs, eager elsewhere).
    State: `momentum_buffer` per parameter, as torch keeps it.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_backend: str = "auto",
    ) -> None:
        defaults = muon_defaults(
            lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype, ns_backend
        )
        super().__init__(params, defaults)
        self._workspace = Workspace()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._workspace = Workspace()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "ns_dtype" in param_group:
            param_group["ns_dtype"] = dtype_name(param_group["ns_dtype"])
        super().add_param_group(param_group)
        validate_muon_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step for every parameter that has a gradient; returns the closure's loss, if given."""
        loss = run_closure(closure)
        self.last_report = muon_step(self.param_groups, self.state, self._workspace)
        return loss


@torch.no_grad()
def muon_step(
    groups: Sequence[MutableMapping[str, Any]],
    state: MutableMapping[Tensor, dict[str, Any]],
    workspace: Workspace | None = None,
    counter: CommCounter | None = None,
) -> MuonReport:
    """One Muon step over `groups` (param groups holding Muon's hyperparameters), with momentum buffers in
    `state[param]["momentum_buffer"]`. Matrices of one shape and Newton-Schulz setting are orthogonalised
    together, whichever group they belong to. An optimizer passes the same `workspace` at every step.

    DTensor parameters step on their local shards; matrices their shards split go to owner ranks
    (`zaya.optim.distributed`), whose collectives `counter` counts. Returns what this rank orthogonalised."""

    report = MuonReport()
    batches: dict[tuple, Batch] = {}
    sharded = []  # every DTensor parameter: the owners' plan weighs them all
    index = -1
    for group in groups:
        settings = (group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"], group["ns_dtype"])
        lr = _value(group["lr"])  # a tensor lr: its current value, read once per step
        decay = 1 - lr * group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise ZayaError("Muon: sparse gradients are not supported")
            param_state = state[param]
            if "momentum_buffer" not in param_state:
                param_state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            index += 1
            if 0 in param.shape[-2:]:  # an empty matrix: nothing to orthogonalise or update
                continue
            rows, cols = param.shape[-2:]
            rate = adjusted_lr(lr, group["adjust_lr_fn"], rows, cols)
            buffer = param_state["momentum_buffer"]
            layout = shard_layout(param)
            plan_layout = MatrixLayout(tuple(param.shape), layout.dim)
            if not plan_layout.local_matrices or layout.replicas > 1:  # to owners, over every replica
                entry = SplitMatrices(index, param, param.grad, buffer, layout, group["momentum"], group["nesterov"],
                                      decay, rate, (settings, group["ns_backend"]))
                sharded.append((index, plan_layout, layout, entry))
                continue
            if is_dtensor(param):
                sharded.append((index, plan_layout, layout, None))
            weights = local(param)
            first = layout.bounds(param.shape[0])[0] if param.ndim == 3 and not layout.whole else 0
            report.add(index, first, weights.shape[0] if weights.ndim == 3 else 1, rows, cols)
            if weights.numel() == 0:  # an empty shard of a stack
                continue
            direction = _Direction(local(param.grad), local(buffer), group["momentum"], group["nesterov"])
            key = (rows, cols, direction.device, settings, group["ns_backend"])
            batches.setdefault(key, Batch(rows, cols, direction.device)).items.append(
                _Step(weights, direction, decay, rate)
            )
    for (_, _, _, (steps, coefficients, eps, dtype_name), backend), batch in batches.items():
        batch.run(steps, coefficients, eps, NS_DTYPES[dtype_name], backend, _Step.apply, workspace)
    if any(entry is not None for *_, entry in sharded):
        owner_step(sharded, workspace, counter, report)
    return report


@dataclass
class _Step:
    """One parameter's part of a Muon step: W <- decay W - rate O, with decay = 1 - lr lambda and
    rate = lr s(m, n)."""

    param: Tensor
    direction: _Direction
    decay: float
    rate: float

    @property
    def shape(self) -> torch.Size:
        return self.direction.shape

    @property
    def device(self) -> torch.device:
        return self.direction.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        self.direction.write(out_BMN, start, stop, eps, workspace)

    def apply(self, start: int, stop: int, orthogonal_BMN: Tensor) -> None:
        """W <- decay W - rate O for matrices [start, stop) of the parameter, with O their orthogonalised
        directions."""
        for param, orthogonal in cpu_slices(as_stack(self.param)[start:stop], orthogonal_BMN):
            if self.decay != 1:
                param.mul_(self.decay)
            param.add_(orthogonal, alpha=-self.rate)


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """The loss of an optimizer's closure (re-evaluated with gradients enabled), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name under which a param group stores its Newton-Schulz dtype ("bfloat16" or "float32")."""
    if isinstance(dtype, torch.dtype):
        for name, value in NS_DTYPES.items():
            if value == dtype:
                return name
        raise ZayaError(f"Muon: 'ns_dtype' must be one of {', '.join(NS_DTYPES)}, got {dtype}")
    return {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
