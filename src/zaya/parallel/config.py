"""`[parallel]` of a run config, and what `parallelize` applies to a model: plain settings, read without torch.

The mesh's dimensions, outermost first: dp_replicate (HSDP replicas), dp_shard (FSDP2 shards), cp (context
parallelism); see `zaya.parallel.mesh`. Expert parallelism (`ep`) is no dimension of its own: it splits the
dp_shard x cp ranks, as torchtitan's does, into groups of `ep` consecutive ranks that hold different experts and
exchange tokens (`zaya.parallel.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zaya.errors import ZayaError

DEFAULT_INIT_TIMEOUT_S = 600.0
ACTIVATION_CHECKPOINTING = ("none", "full", "moe")
MESH_DIMS = ("dp_replicate", "dp_shard", "cp")
BACKENDS = ("auto", "nccl", "gloo")
CP_KERNELS = ("allgather", "ring")
CP_SHARDINGS = ("headtail", "contiguous")
# "full": parameters gathered for every micro-batch's forward and again for its backward, gradients reduced
# after each; "zero2": gathered once per step and kept to its end, gradients accumulated whole and reduced
# once; "zero1" (ZAYA1's): kept whole across steps and gathered again once after each update
# (`zaya.parallel.fsdp`)
SHARDINGS = ("full", "zero2", "zero1")
# "config": the layout the keys say; "auto": the planner's fastest layout that fits the job as launched (its world
# size, devices per node and device), the keys the config gives kept as they are (`zaya.plan.auto`)
LAYOUTS = ("config", "auto")


@dataclass
class ParallelConfig:
    """`[parallel]`: the mesh, the collective library and the timeouts."""

    # "auto": at start-up the planner picks dp_replicate, dp_shard, cp (per phase), ep, sharding,
    # train.micro_batch_size and train.activation_checkpointing for the job's ranks and device, keeping those the
    # config file or --set gives; a resume on as many ranks keeps the layout chosen (docs/planning.md)
    layout: str = "config"
    dp_replicate: int = 1  # HSDP replicas, each a full copy of the sharded state (usually one per node)
    dp_shard: int = -1  # -1: every rank the other dimensions leave
    cp: int = 1  # context-parallel ranks that split each sequence
    ep: int = 1  # expert parallelism: each block's experts split over groups of ep of the dp_shard x cp ranks
    sharding: str = "full"  # "zero2", "zero1": parameters gathered and gradients reduced once per step
    cp_kernel: str = "allgather"  # "ring" passes key/value blocks rank to rank, overlapped with compute
    cp_sharding: str = "headtail"  # "contiguous": chunk r on rank r (for debugging; unbalanced work)
    # chunks per rank of a phase that keeps packed documents apart (data.isolate_documents): each sequence is cut
    # into cp x cp_document_chunks chunks, dealt out to the ranks by their attention work, so that a rank whose
    # chunks lie in long documents does not keep the others waiting; 2: head-tail's fixed pairs, not balanced.
    # Contiguous sharding is never balanced (it ignores this key).
    cp_document_chunks: int = 8
    backend: str = "auto"  # "auto": nccl on GPUs (CUDA and ROCm), gloo on the CPU
    timeout_s: float = 1800.0  # every process group's collective timeout
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S  # joining the job: the store, the start-up check

    def validate(self, source: str) -> None:
        """Refuse values that fit no world size, naming the key."""
        for key in ("dp_replicate", "cp", "ep"):
            if getattr(self, key) < 1:
                raise ZayaError(f"{source}: key 'parallel.{key}' must be at least 1, got {getattr(self, key)}")
        if self.cp_document_chunks < 2:
            raise ZayaError(f"{source}: key 'parallel.cp_document_chunks' must be at least 2 (2: head-tail's fixed "
                            f"pairs), got {self.cp_document_chunks}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ZayaError(f"{source}: key 'parallel.dp_shard' must be at least 1, or -1 for every rank the "
                            f"other dimensions leave, got {self.dp_shard}")
        for key, allowed in (("cp_kernel", CP_KERNELS), ("cp_sharding", CP_SHARDINGS), ("sharding", SHARDINGS),
                             ("layout", LAYOUTS)):
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
        if (shard * cp) % self.ep:
            raise ZayaError(f"{source}: parallel.ep = {self.ep} does not divide parallel.dp_shard x cp = {shard} x "
                            f"{cp} = {shard * cp} (the experts are split over groups of ep of those ranks)")
        return replicate, shard, cp


def experts_split_problem(num_experts: int, ep: int) -> str | None:
    """What is wrong with splitting `num_experts` experts over `ep` ranks (None if nothing): whole experts,
    the same number on every rank."""
    if num_experts % ep:
        return f"{num_experts} experts do not split into parallel.ep = {ep} equal groups of whole experts"
    return None


def sequence_split_problem(length: int, ranks: int, sharding: str, min_chunk: int = 1,
                           chunks_per_rank: int | None = None) -> str | None:
    """What is wrong with splitting a sequence of `length` tokens over `ranks` context-parallel ranks (None if
    nothing): chunks (2 per rank head-tail, 1 contiguous) must be whole and hold at least `min_chunk` tokens (the
    convolutions' halo reaches back one chunk only). `chunks_per_rank`: a phase that keeps packed documents
    apart (`ParallelConfig.cp_document_chunks`), whose head-tail split deals cp x chunks_per_rank chunks out by
    attention work; contiguous sharding ignores it."""
    if sharding not in CP_SHARDINGS:
        return f"sharding must be one of {', '.join(CP_SHARDINGS)}, got {sharding!r}"
    chunks = 2 * ranks if sharding == "headtail" else ranks
    how = "2 x cp" if sharding == "headtail" else "cp"
    if chunks_per_rank is not None and sharding == "headtail":
        if chunks_per_rank < 1:
            return f"a split into {chunks_per_rank} chunks per rank; it needs at least 1"
        chunks, how = ranks * chunks_per_rank, f"cp x parallel.cp_document_chunks = {ranks} x {chunks_per_rank}"
    if length % chunks:
        return f"a sequence of {length} tokens does not split into {how} = {chunks} chunks of equal length"
    if length // chunks < min_chunk:
        return (f"chunks of {length // chunks} tokens ({length} over {chunks}) are shorter than the {min_chunk} "
                "tokens the convolutions reach back")
    return None


@dataclass(frozen=True)
class ParallelizeConfig:
    """What `zaya.parallel.fsdp.parallelize` applies to a model besides the mesh: activation checkpointing,
    compilation, bf16 mixed precision (parameters gathered in bf16, gradients reduced in fp32) and the sharding
    mode."""

    activation_checkpointing: str = "none"  # one of ACTIVATION_CHECKPOINTING
    compile: bool = False
    bf16: bool = False
    sharding: str = "full"  # one of SHARDINGS
