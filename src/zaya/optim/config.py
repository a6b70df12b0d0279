"""`[optim]`: the hyperparameters of Muon + AdamW, validated on construction (no torch needed to read them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from zaya.errors import ZayaError

# the quintic Newton-Schulz iteration's defaults (zaya.optim.ns_iteration)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPE_NAMES = ("bfloat16", "float32")
NS_BACKENDS = ("auto", "eager", "compiled")
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # Muon's update scaling (zaya.optim.muon.adjusted_lr)


@dataclass
class OptimConfig:
    """Hyperparameters of the Muon + AdamW optimizer; validated on construction."""

    # Muon's rate, and AdamW's unless adamw_lr is set. 0.01 is the best measured at widths 192-256 (0.6 nats
    # below 1e-3 in two minutes: docs/benchmarks.md#time-to-quality); wider models want less (zaya1-base: 0.002)
    lr: float = 0.01
    weight_decay: float = 0.1  # decoupled; on the matrices (Muon's, the embedding, the convolutions)
    adamw_lr: float | None = None  # AdamW's rate; unset: lr
    # the vectors' rate (norms, biases, residual scales and biases, EDA gammas, temperatures) over AdamW's: at
    # AdamW's full rate their first steps move every token's stream and router input alike, and the routers
    # send every token to one expert (docs/design.md, "Optimizer")
    vector_lr_ratio: float = 0.03
    adamw_betas: tuple[float, float] = (0.9, 0.95)  # AdamW's (beta1, beta2)
    adamw_eps: float = 1e-8  # AdamW's epsilon
    decay_vectors: bool = False  # also decay norms, biases, scales, EDA gammas and temperatures
    momentum: float = 0.95  # Muon's
    nesterov: bool = True  # Nesterov momentum in Muon
    ns_steps: int = NS_STEPS  # Newton-Schulz iterations per Muon update
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS  # (a, b, c) of the quintic Newton-Schulz iteration
    ns_eps: float = NS_EPS  # the iteration starts from U / max(||U||_F, ns_eps)
    ns_dtype: str = "bfloat16"  # precision of the Newton-Schulz iteration: "bfloat16" or "float32"
    ns_backend: str = "auto"  # "eager", "compiled" or "auto" (compiled on GPUs, eager on the CPU)
    adjust_lr_fn: str = "match_rms_adamw"  # or "original": sqrt(max(1, rows / cols))

    def __post_init__(self) -> None:
        self._tuples_from_lists()
        self.validate()

    def _tuples_from_lists(self) -> None:
        # a JSON or YAML config gives lists where the fields hold tuples
        for name in ("adamw_betas", "ns_coefficients"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))

    @property
    def adamw_rate(self) -> float:
        return self.lr if self.adamw_lr is None else self.adamw_lr

    def rate(self, algorithm: str, role: str) -> float:
        """The configured rate of a param group of `algorithm` ("muon", "adamw") holding parameters of `role`
        (`zaya.model.groups`: "matrix", "weight", "vector", or "other")."""
        if algorithm == "muon":
            return self.lr
        return self.adamw_rate * (self.vector_lr_ratio if role == "vector" else 1.0)

    def validate(self, source: str = "optimizer config") -> None:
        """Raise `ZayaError` naming the first field that cannot configure the optimizer."""
        for name in ("lr", "adamw_eps", "ns_eps", "vector_lr_ratio"):
            if not positive_number(getattr(self, name)):
                raise ZayaError(f"{source}: field '{name}' must be a positive number, got {getattr(self, name)!r}")
        if self.adamw_lr is not None and not positive_number(self.adamw_lr):
            raise ZayaError(f"{source}: field 'adamw_lr' must be a positive number or null, got {self.adamw_lr!r}")
        if not finite_number(self.weight_decay) or self.weight_decay < 0:
            raise ZayaError(f"{source}: field 'weight_decay' must be a non-negative number, got {self.weight_decay!r}")
        betas = self.adamw_betas
        if not isinstance(betas, tuple) or len(betas) != 2 or not all(finite_number(b) and 0 <= b < 1 for b in betas):
            raise ZayaError(f"{source}: field 'adamw_betas' must be two numbers in [0, 1), got {betas!r}")
        if not finite_number(self.momentum) or not 0 <= self.momentum < 1:
            raise ZayaError(f"{source}: field 'momentum' must be in [0, 1), got {self.momentum!r}")
        for name in ("nesterov", "decay_vectors"):
            if not isinstance(getattr(self, name), bool):
                raise ZayaError(f"{source}: field '{name}' must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or not 1 <= self.ns_steps < 100:
            raise ZayaError(f"{source}: field 'ns_steps' must be an integer in 1..99, got {self.ns_steps!r}")
        coefficients = self.ns_coefficients
        if not isinstance(coefficients, tuple) or len(coefficients) != 3 or not all(map(finite_number, coefficients)):
            raise ZayaError(f"{source}: field 'ns_coefficients' must be three numbers (a, b, c), got {coefficients!r}")
        choices = {"ns_dtype": NS_DTYPE_NAMES, "ns_backend": NS_BACKENDS, "adjust_lr_fn": ADJUST_LR_FNS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ZayaError(
                    f"{source}: field '{name}' must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "optimizer config") -> OptimConfig:
        """Build from a dict (a config file's section), refusing unknown fields with a message naming `source`."""
        if not isinstance(data, dict):
            raise ZayaError(f"{source}: expected an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ZayaError(f"{source}: unknown field '{unknown[0]}'")
        config = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            setattr(config, f.name, data.get(f.name, f.default))
        config._tuples_from_lists()
        config.validate(source)
        return config


def finite_number(value: Any) -> bool:
    """An int or float (not a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_number(value: Any) -> bool:
    return finite_number(value) and value > 0
