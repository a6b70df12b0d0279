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

Every group, the default one, each mesh dimension's and a separate gloo control group (checkpoint barriers
and async saves, never queued behind training collectives), is made with the configured timeout, long
enough that a network blip does not kill a long job (the supervisor's heartbeats catch real hangs much
sooner), and lives under the restart-safe store of `zaya.parallel.launch`.
"""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zaya.device import distributed_backend
from zaya.errors import ZayaError
from zaya.parallel.comm import CommCounter
from zaya.parallel.launch import DEFAULT_INIT_TIMEOUT_S, Launch

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")
BACKENDS = ("auto", "nccl", "gloo")
CP_KERNELS = ("allgather", "ring")
CP_SHARDINGS = ("headtail", "contiguous")


@dataclass
class ParallelConfig:
    """`[parallel]`: the mesh, the collective library and the timeouts."""

    dp_replicate: int = 1  # HSDP replicas, each a full copy of the sharded state (usually one per node)
    dp_shard: int = -1  # -1: every rank the other dimensions leave
    cp: int = 1  # context-parallel ranks that split each sequence
    cp_kernel: str = "allgather"  # "ring" passes key/value blocks rank to rank, overlapped with compute
    cp_sharding: str = "headtail"  # "contiguous": chunk r on rank r (for debugging; unbalanced work)
    backend: str = "auto"  # "auto": nccl on GPUs (CUDA and ROCm), gloo on the CPU
    timeout_s: float = 1800.0  # every process group's collective timeout
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S  # joining the job: the store, the start-up check

    def validate(self, source: str) -> None:
        """Refuse values that fit no world size, naming the key."""
        for key in ("dp_replicate", "cp"):
            if getattr(self, key) < 1:
                raise ZayaError(f"{source}: key 'parallel.{key}' must be at least 1, got {getattr(self, key)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ZayaError(f"{source}: key 'parallel.dp_shard' must be at least 1, or -1 for every rank the "
                            f"other dimensions leave, got {self.dp_shard}")
        for key, allowed in (("cp_kernel", CP_KERNELS), ("cp_sharding", CP_SHARDINGS)):
            if getattr(self, key) not in allowed:
                raise ZayaError(f"{source}: key 'parallel.{key}' must be one of {', '.join(allowed)}, "
                                f"got {getattr(self, key)!r}")
        if self.backend not in BACKENDS:
            raise ZayaError(f"{source}: key 'parallel.backend' must be one of {', '.join(BACKENDS)}, "
                            f"got {self.backend!r}")
        for key in ("timeout_s", "init_timeout_s"):
            if not getattr(self, key) > 0:
                raise ZayaError(f"{source}: key 'parallel.{key}' must be positive, got {getattr(self, key)}")

    def shape(self, world_size: int, source: str) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, cp) for `world_size` ranks, `dp_shard = -1` filled in."""
        replicate, shard, cp = self.dp_replicate, self.dp_shard, self.cp
        if shard == -1:
            if world_size % (replicate * cp):
                raise ZayaError(f"{source}: {world_size} ranks do not divide into parallel.dp_replicate = "
                                f"{replicate} x parallel.cp = {cp} (parallel.cp must divide the world size)")
            shard = world_size // (replicate * cp)
        if replicate * shard * cp != world_size:
            raise ZayaError(f"{source}: parallel.dp_replicate x dp_shard x cp = {replicate} x {shard} x {cp} = "
                            f"{replicate * shard * cp}, but the job has {world_size} ranks")
        return replicate, shard, cp

    def backend_for(self, device: torch.device, source: str) -> str:
        backend = distributed_backend(device) if self.backend == "auto" else self.backend
        if backend == "nccl" and device.type != "cuda":
            raise ZayaError(f"{source}: key 'parallel.backend' is 'nccl', which needs GPUs, but training runs on "
                            f"{device}")
        return backend


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
        return (f"mesh {sizes} = {self.world_size} rank(s) on {self.backend}; timeouts: collectives "
                f"{self.timeout_s:g} s, start-up {self.init_timeout_s:g} s")

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            # DTensor collectives leave reference cycles holding gloo work; collected during interpreter
            # finalisation they abort the process now and then ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def init_parallel(
    config: ParallelConfig, device: torch.device, launch: Launch, source: str = "config"
) -> ParallelContext:
    """Join the job (or make a one-process one) and build the mesh; see the module docstring."""
    shape = config.shape(launch.world_size, source)
    backend = config.backend_for(device, source)
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
    control = dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(launch, mesh, fsdp_mesh, backend, control, config.timeout_s, config.init_timeout_s,
                           owns_process_group=owns)


def _dimension_group(shape: tuple[int, ...], dim: int, rank: int, backend: str, timeout: datetime.timedelta):
    """This rank's process group along mesh dimension `dim`: made by its own members only (local
    synchronisation), so that a job of many ranks does not make every group on every rank."""
    layout = torch.arange(torch.Size(shape).numel()).view(shape)
    lines = layout.movedim(dim, -1).reshape(-1, shape[dim])
    mine = next(line for line in lines.tolist() if rank in line)
    return dist.new_group(ranks=mine, timeout=timeout, backend=backend, use_local_synchronization=True)
