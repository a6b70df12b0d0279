"""The parameters of a model as the planner sees them: their shapes, which FSDP2 unit each belongs to and which
optimizer updates it, read from a model built on the meta device (no weights are allocated, so ZAYA1-base's
8.3B parameters cost nothing) with the same functions the trainer uses (`zaya.parallel.fsdp.unit_parameters`,
`zaya.optim.hybrid.split_parameters`). Every prediction of `zaya.plan` starts from here, so that a change to
the model, its sharding or its optimizer split reaches the predictions without a second description of them.

Expert parallelism (`parallel.ep`) changes what FSDP2 shards, not the model: each rank keeps 1/ep of every
block's stacked experts (whole experts) and shards them over the dp_shard x cp ranks that hold the same ones
(the expert-data-parallel group, 1/ep of those ranks); `Inventory.sharded_units` gives the units as they are
sharded then, each block split into its experts and the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from zaya.model.config import ZayaConfig
from zaya.model.transformer import Zaya
from zaya.optim.hybrid import split_parameters
from zaya.parallel.dtensor import chunk_bounds
from zaya.parallel.fsdp import replicated_parameters, shard_dim, unit_parameters


@dataclass(frozen=True)
class Param:
    """One parameter: its shape, the optimizer that updates it, and whether it is a stack of experts (`expert`,
    experts along dimension 0), which expert parallelism splits."""

    shape: tuple[int, ...]
    muon: bool
    expert: bool = False

    @functools.cached_property
    def numel(self) -> int:
        return _prod(self.shape)

    def shard_numel(self, ranks: int, rank: int) -> int:
        """Elements of `rank`'s shard among `ranks` (FSDP2 splits along `shard_dim`, as `torch.chunk` does)."""
        dim = shard_dim(self.shape, ranks)
        start, stop = chunk_bounds(self.shape[dim], ranks, rank)
        return (stop - start) * self.numel // self.shape[dim] if self.shape[dim] else 0

    def padded_shard_numel(self, ranks: int) -> int:
        """Elements of every rank's shard storage: FSDP2 pads each shard to the largest one."""
        dim = shard_dim(self.shape, ranks)
        return -(-self.shape[dim] // ranks) * (self.numel // self.shape[dim]) if self.shape[dim] else 0

    def local(self, ep: int) -> Param:
        """What one rank of `ep` expert-parallel ranks holds of this stack of experts: 1/ep of them, whole."""
        return Param((self.shape[0] // ep, *self.shape[1:]), self.muon, self.expert)


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` call: its parameters, whether they stay fp32 under bf16 mixed precision, whether FSDP
    frees them after forward, and whether it is a transformer block (the rest is the root). `ep` > 1: this
    rank's 1/ep of a block's experts, which FSDP2 shards over 1/ep of the dp_shard x cp ranks (`shard_ranks`)."""

    params: tuple[Param, ...]
    keep_fp32: bool
    reshard_after_forward: bool
    block: bool
    ep: int = 1
    _padded: dict[int, int] = field(default_factory=dict, compare=False, hash=False, repr=False)
    _split: dict[int, tuple[Unit, ...]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @functools.cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def padded_shard_numel(self, ranks: int) -> int:
        if ranks not in self._padded:  # a layout search asks for every unit at every layout
            self._padded[ranks] = sum(p.padded_shard_numel(ranks) for p in self.params)
        return self._padded[ranks]

    def shard_ranks(self, shard_ranks: int) -> int:
        """The ranks this unit is sharded over, of the `shard_ranks` (dp_shard x cp) FSDP2 ranks."""
        return shard_ranks // self.ep

    def split(self, ep: int) -> tuple[Unit, ...]:
        """The unit as FSDP2 shards it with `ep` expert-parallel ranks: itself with ep = 1 or without experts;
        else its other parameters, and its experts (this rank's 1/ep of them) as a unit of their own."""
        if ep == 1:
            return (self,)
        if ep not in self._split:
            if not any(p.expert for p in self.params):
                self._split[ep] = (self,)
                return self._split[ep]
            rest = tuple(p for p in self.params if not p.expert)
            experts = tuple(p.local(ep) for p in self.params if p.expert)
            parts = [Unit(experts, self.keep_fp32, self.reshard_after_forward, self.block, ep)]
            if rest:
                parts.insert(0, Unit(rest, self.keep_fp32, self.reshard_after_forward, self.block))
            self._split[ep] = tuple(parts)
        return self._split[ep]


@dataclass(frozen=True, eq=False)  # hashed by identity: one instance per config (`inventory` caches them)
class Inventory:
    """All parameters of a model config: by FSDP2 unit, and those no unit takes (whole on every rank)."""

    units: tuple[Unit, ...]
    replicated: tuple[Param, ...] = ()
    _sharded: dict[int, tuple[Unit, ...]] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def params(self) -> tuple[Param, ...]:
        """The sharded parameters."""
        return tuple(p for unit in self.units for p in unit.params)

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the sharded parameters."""
        return sum(unit.numel for unit in self.units)

    @functools.cached_property
    def replicated_numel(self) -> int:
        return sum(p.numel for p in self.replicated)

    def block_units(self) -> tuple[Unit, ...]:
        return tuple(unit for unit in self.units if unit.block)

    def sharded_units(self, ep: int = 1) -> tuple[Unit, ...]:
        """The units as FSDP2 shards them with `ep` expert-parallel ranks (`Unit.split`); `units` with ep = 1."""
        if ep not in self._sharded:
            self._sharded[ep] = tuple(part for unit in self.units for part in unit.split(ep))
        return self._sharded[ep]


_INVENTORIES: dict[str, Inventory] = {}
_KEYS: dict[int, tuple[ZayaConfig, str]] = {}


def config_key(config: ZayaConfig) -> str:
    """`repr(config)`, the key of the caches of what a config implies, remembered for the object itself until
    `forget_keys` (a layout search asks for it hundreds of thousands of times, and writing out every field of the
    config each time was a sixth of the search)."""
    entry = _KEYS.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_KEYS) >= 64:
            _KEYS.clear()
        entry = _KEYS[id(config)] = (config, repr(config))
    return entry[1]


def forget_keys() -> None:
    """Derive every config's key afresh from its fields: each plan starts so (`zaya.plan.planner.Planner`), in
    case a config object changed since the last."""
    _KEYS.clear()


def inventory(config: ZayaConfig) -> Inventory:
    """The `Inventory` of a model of `config` (cached by the config's fields: a layout search asks for it tens
    of thousands of times)."""
    key = config_key(config)
    if key not in _INVENTORIES:
        if len(_INVENTORIES) >= 16:
            _INVENTORIES.clear()
        _INVENTORIES[key] = _inventory(config)
    return _INVENTORIES[key]


def _inventory(config: ZayaConfig) -> Inventory:
    with torch.device("meta"):
        model = Zaya(config)
    muon = {id(p) for spec in split_parameters(model) if spec.algorithm == "muon" for p in spec.params}
    experts = {id(p) for block in model.blocks for p in block.moe.experts.parameters()}
    blocks = {id(block) for block in model.blocks}
    units = []
    for unit, params in unit_parameters(model):
        members = tuple(Param(tuple(p.shape), id(p) in muon, id(p) in experts) for p in params)
        units.append(Unit(members, unit.keep_fp32, unit.reshard_after_forward, id(unit.module) in blocks))
    replicated = tuple(Param(tuple(p.shape), id(p) in muon) for p in replicated_parameters(model))
    return Inventory(tuple(units), replicated)


def _prod(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
