"""The process groups and the device mesh of a run, from `[parallel]` and the launcher's environment.

One `DeviceMesh` with named dimensions, outermost first:

    dp_replicate   HSDP replicas (each holds a full copy of the sharded state); usually across nodes
    dp_shard       FSDP2 shards the parameters, gradients and optimizer state over these ranks
    cp             context parallelism: the ranks of a cp group split one sequence (zaya.parallel.context)
                   and read the same data

Rank r sits at (r // (S C), (r // C) % S, r % C) for sizes (R, S, C), so a node's consecutive ranks share
their dp_shard and cp groups. FSDP2 shards over dp_shard and cp together (`ParallelContext.fsdp_mesh`, the
dimension `dp_shard_cp` of S C ranks, as in torchtitan): context-parallel ranks hold different tokens of
the same sequences, so their gradients are summed like those of different data, and the parameters and
optimizer state are spread over all of them.

Expert parallelism (`parallel.ep`) splits the dp_shard_cp ranks into groups of ep consecutive ranks: flat
index f (of S C) is ep rank f % ep of expert group f // ep. A group's ranks hold different experts and trade
tokens (`ExpertMesh.group`); the ranks holding the same experts, every ep-th, shard them with FSDP2 among
themselves (`ExpertMesh.fsdp_mesh`, with the replicas under HSDP).

Every group, the default one, each mesh dimension's and a separate gloo control group (checkpoint barriers
and async saves, never queued behind training collectives), is made with the configured timeout, long
enough that a network blip does not kill a long job (the supervisor's heartbeats catch real hangs much
sooner), and lives on the attempt's own store of `zaya.parallel.launch`.
"""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zaya.device import backend_fits, distributed_backend
from zaya.errors import ZayaError
from zaya.parallel.comm import CommCounter
from zaya.parallel.config import MESH_DIMS, ParallelConfig
from zaya.parallel.launch import Launch


@dataclass(frozen=True)
class ExpertMesh:
    """Where a run with `parallel.ep > 1` keeps its experts. `group`: the `size` ranks that trade tokens, this
    one being `rank` among them (it holds experts [rank E/size, (rank + 1) E/size)). `fsdp_mesh`: what FSDP2
    shards those experts over, (dp_replicate, expert shards) or (expert shards,). `state_mesh`: the same ranks
    as (dp_replicate, ep, expert shards) or (ep, expert shards), on which a checkpoint sees each expert stack
    whole ([E, ...], `zaya.parallel.experts.global_state`)."""

    group: object
    size: int
    rank: int
    fsdp_mesh: DeviceMesh
    state_mesh: DeviceMesh


@dataclass
class ParallelContext:
    """Everything a run knows about its place in the job; `close()` ends the process groups it made."""

    launch: Launch
    mesh: DeviceMesh
    fsdp_mesh: DeviceMesh  # (dp_replicate, dp_shard_cp) with HSDP, else (dp_shard_cp,): what FSDP2 shards over
    backend: str
    control_group: object
    timeout_s: float
    init_timeout_s: float
    counter: CommCounter = field(default_factory=CommCounter)
    owns_process_group: bool = True
    experts: ExpertMesh | None = None  # with parallel.ep > 1

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    @property
    def dp_size(self) -> int:
        """Ranks that read different data: replicas times shards (context-parallel ranks share theirs)."""
        return self.mesh["dp_replicate"].size() * self.mesh["dp_shard"].size()

    @property
    def cp_size(self) -> int:
        return self.mesh["cp"].size()

    @property
    def cp_group(self):
        return self.mesh.get_group("cp")

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp_replicate"].get_local_rank() * self.mesh["dp_shard"].size() + \
            self.mesh["dp_shard"].get_local_rank()

    def describe(self) -> str:
        sizes = " x ".join(f"{name} {self.mesh[name].size()}" for name in MESH_DIMS)
        if self.experts is not None:
            sizes += f" (experts over ep {self.experts.size})"
        return (f"mesh {sizes} = {self.world_size} rank(s) on {self.backend}; timeouts: collectives "
                f"{self.timeout_s:g} s, start-up {self.init_timeout_s:g} s")

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            # DTensor collectives leave reference cycles holding gloo work; collected during interpreter
            # finalisation they abort the process now and then ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def backend_for(config: ParallelConfig, device: torch.device, source: str) -> str:
    """The collective library `[parallel] backend` resolves to for tensors on `device`."""
    backend = distributed_backend(device) if config.backend == "auto" else config.backend
    if not backend_fits(backend, device):
        raise ZayaError(f"{source}: key 'parallel.backend' is '{backend}', which needs GPUs, but training runs on "
                        f"{device}")
    return backend


def init_parallel(
    config: ParallelConfig, device: torch.device, launch: Launch, source: str = "config"
) -> ParallelContext:
    """Join the job (or make a one-process one) and build the mesh; see the module docstring."""
    shape = config.shape(launch.world_size, source)
    backend = backend_for(config, device, source)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    owns = not dist.is_initialized()
    if owns:
        launch.init_timeout_s = config.init_timeout_s
        dist.init_process_group(backend=backend, store=launch.store(), rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    groups = [_dimension_group(shape, dim, launch.rank, backend, timeout) for dim in range(len(MESH_DIMS))]
    layout = torch.arange(launch.world_size, dtype=torch.int).view(shape)
    mesh = DeviceMesh.from_group(groups, device.type, mesh=layout, mesh_dim_names=MESH_DIMS)
    replicate, shard, cp = shape
    # dp_shard and cp flattened: its own group, unless one of the two has a single rank
    flat = (replicate, shard * cp)
    shard_cp = groups[1] if cp == 1 else groups[2] if shard == 1 else \
        _dimension_group(flat, 1, launch.rank, backend, timeout)
    if replicate > 1:
        fsdp_mesh = DeviceMesh.from_group([groups[0], shard_cp], device.type, mesh=layout.view(flat),
                                          mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    else:
        fsdp_mesh = DeviceMesh.from_group(shard_cp, device.type, mesh=layout.view(-1),
                                          mesh_dim_names=("dp_shard_cp",))
    experts = None
    if config.ep > 1:
        experts = _expert_mesh(layout, config.ep, groups[0], launch.rank, backend, timeout, device.type)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(launch, mesh, fsdp_mesh, backend, control, config.timeout_s, config.init_timeout_s,
                           owns_process_group=owns, experts=experts)


def _expert_mesh(layout: torch.Tensor, ep: int, replicate_group, rank: int, backend: str,
                 timeout: datetime.timedelta, device_type: str) -> ExpertMesh:
    """The `ExpertMesh` of `rank` in the (dp_replicate, dp_shard, cp) `layout`; see the module docstring."""
    replicate = layout.shape[0]
    experts = layout.reshape(replicate, -1, ep)  # (replicas, expert shards, ep)
    shape = tuple(experts.shape)
    ep_group = _dimension_group(shape, 2, rank, backend, timeout)
    shard_group = _dimension_group(shape, 1, rank, backend, timeout)
    where = (experts == rank).nonzero()[0].tolist()
    mine = experts[:, :, where[2]]  # the ranks holding this rank's experts: (replicas, expert shards)
    if replicate > 1:
        fsdp_mesh = DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=mine,
                                          mesh_dim_names=("dp_replicate", "expert_shard"))
        state_mesh = DeviceMesh.from_group([replicate_group, ep_group, shard_group], device_type,
                                           mesh=experts.transpose(1, 2), mesh_dim_names=("dp_replicate", "ep",
                                                                                      "expert_shard"))
    else:
        fsdp_mesh = DeviceMesh.from_group(shard_group, device_type, mesh=mine.view(-1),
                                          mesh_dim_names=("expert_shard",))
        state_mesh = DeviceMesh.from_group([ep_group, shard_group], device_type, mesh=experts[0].t(),
                                           mesh_dim_names=("ep", "expert_shard"))
    return ExpertMesh(ep_group, ep, where[2], fsdp_mesh, state_mesh)


def _dimension_group(shape: tuple[int, ...], dim: int, rank: int, backend: str, timeout: datetime.timedelta):
    """This rank's process group along mesh dimension `dim`: made by its own members only (local
    synchronisation), so that a job of many ranks does not make every group on every rank."""
    layout = torch.arange(torch.Size(shape).numel()).view(shape)
    lines = layout.movedim(dim, -1).reshape(-1, shape[dim])
    mine = next(line for line in lines.tolist() if rank in line)
    return dist.new_group(ranks=mine, timeout=timeout, backend=backend, use_local_synchronization=True)
