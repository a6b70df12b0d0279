"""A parallel layout of a run on a cluster: the mesh, expert parallelism, the micro-batch and activation
checkpointing, with the GPUs it runs on. The planner predicts for one `Layout`; `zaya plan --search` enumerates
them."""

from __future__ import annotations

from dataclasses import dataclass

from zaya.errors import ZayaError
from zaya.parallel.config import experts_split_problem


@dataclass(frozen=True)
class Layout:
    """`gpus` ranks, `gpus_per_node` per node, in the mesh (dp_replicate, dp_shard, cp) of
    `zaya.parallel.mesh` (cp innermost, so that consecutive ranks share their cp and dp_shard groups). `ep`
    (`parallel.ep`) splits the dp_shard x cp ranks into groups of ep consecutive ones that hold different
    experts; the ranks ep apart hold the same ones (`expert_shard_ranks` of them, FSDP2's group for experts)."""

    gpus: int
    gpus_per_node: int
    dp_replicate: int
    dp_shard: int
    cp: int
    micro_batch_size: int
    activation_checkpointing: str
    compiled: bool = True  # blocks compiled (`train.compile`, on for accelerators): FSDP2's units differ
    sharding: str = "full"  # `parallel.sharding`: "zero2" and "zero1" gather and reduce once per step
    ep: int = 1  # `parallel.ep`: expert-parallel ranks

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards over: dp_shard x cp (`ParallelContext.fsdp_mesh`)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks that hold the same experts and shard them: dp_shard x cp / ep."""
        return self.shard_ranks // self.ep

    @property
    def dp(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    def spans_nodes(self, group_size: int, stride: int) -> bool:
        """Whether some group of `group_size` ranks spaced `stride` apart (the mesh dimension of that stride)
        has members on different nodes, so that its collectives cross the network."""
        if group_size == 1:
            return False
        period = min(self.gpus, self.gpus_per_node * group_size * stride)
        for base in range(period):
            if (base // stride) % group_size == 0:  # the group's first member
                last = base + (group_size - 1) * stride
                if base // self.gpus_per_node != last // self.gpus_per_node:
                    return True
        return False

    def describe(self) -> str:
        return (f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} on {self.gpus} GPU(s) "
                f"({self.gpus_per_node} per node), ep {self.ep}, {self.sharding} sharding, "
                f"micro-batch {self.micro_batch_size}, "
                f"activation checkpointing {self.activation_checkpointing}")

    def settings(self) -> list[str]:
        """The `--set` overrides that give a run this layout (with `train.compile` as it is). dp_shard is left to
        fill the GPUs (-1), as the planner fills it for a phase with a cp of its own."""
        return [f"parallel.dp_replicate={self.dp_replicate}", "parallel.dp_shard=-1",
                f"parallel.cp={self.cp}", f"parallel.ep={self.ep}", f"parallel.sharding={self.sharding}",
                f"train.micro_batch_size={self.micro_batch_size}",
                f"train.activation_checkpointing={self.activation_checkpointing}"]


def check_batch(global_batch: int, layout: Layout, what: str, source: str) -> None:
    """A global batch of `global_batch` sequences must split evenly over the data-parallel ranks (each rank
    then cuts its share into micro-batches of at most `micro_batch_size`), as the trainer requires."""
    if global_batch % layout.dp:
        raise ZayaError(f"{source}: key '{what}': a global batch of {global_batch} sequences does not divide "
                        f"over {layout.dp} data-parallel ranks (dp_replicate {layout.dp_replicate} x dp_shard "
                        f"{layout.dp_shard}, with cp = {layout.cp})")


def expert_parallel_problem(num_experts: int, layout: Layout) -> str | None:
    """What keeps `layout`'s expert parallelism from running (None if nothing): the rules
    `zaya.parallel.config` holds a run's `[parallel]` to, for a layout the search made."""
    if layout.shard_ranks % layout.ep:
        return (f"parallel.ep = {layout.ep} does not divide dp_shard x cp = {layout.dp_shard} x {layout.cp} = "
                f"{layout.shard_ranks}")
    return experts_split_problem(num_experts, layout.ep)
