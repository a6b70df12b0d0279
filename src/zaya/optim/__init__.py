"""Optimizers: Muon (batched Newton-Schulz) for the matrices, AdamW for the rest, and learning-rate schedules."""

from zaya.optim.hybrid import (
    MuonAdamW,
    OptimConfig,
    ParamGroupSpec,
    build_optimizer,
    describe_param_groups,
    split_parameters,
)
from zaya.optim.muon import Muon, adjusted_lr, muon_step, muon_update
from zaya.optim.ns_iteration import newton_schulz, newton_schulz_flops, orthogonalize
from zaya.optim.schedule import ScheduleConfig, cosine, set_lr_multiplier, wsd

__all__ = [
    "Muon",
    "MuonAdamW",
    "OptimConfig",
    "ParamGroupSpec",
    "ScheduleConfig",
    "adjusted_lr",
    "build_optimizer",
    "cosine",
    "describe_param_groups",
    "muon_step",
    "muon_update",
    "newton_schulz",
    "newton_schulz_flops",
    "orthogonalize",
    "set_lr_multiplier",
    "split_parameters",
    "wsd",
]
