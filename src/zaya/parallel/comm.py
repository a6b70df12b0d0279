"""Bytes on the wire: every collective of a training step goes through here and is counted as it is issued.

A rank's traffic is counted as the bytes it sends under the bandwidth-optimal algorithm of each collective
(what NCCL's and RCCL's ring and tree kernels achieve for large messages), over a group of N ranks:

    all-gather of a shard of S bytes          S (N - 1)
    reduce-scatter of an input of S bytes     S (N - 1) / N
    all-reduce of S bytes                     2 S (N - 1) / N
    all-to-all                                the bytes addressed to the other ranks
    broadcast of S bytes                      S, on every rank but the last of the chain src, src + 1, ...
    ring shift (send to the next rank)        the bytes sent

FSDP2's own all-gathers and reduce-scatters are counted through its custom-communication hooks (the default
kernels, with a counter in front), its HSDP all-reduce through its all-reduce hook; the optimizer's and the
trainer's collectives call the functions below. Counting costs a few integer operations per collective.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

try:  # the default kernels of FSDP2, subclassed so that FSDP keeps treating them as its defaults
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # an older torch: FSDP's traffic is then not counted
    DefaultAllGather = DefaultReduceScatter = None


class CommCounter:
    """Bytes this rank has sent, in total and by kind of collective, since the last `take()`."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()

    def add(self, kind: str, nbytes: float) -> None:
        self.by_kind[kind] += int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def take(self) -> dict[str, int]:
        """The counts so far ({kind: bytes}), and start again from zero."""
        counts, self.by_kind = dict(self.by_kind), Counter()
        return counts

    # -- the formulas of the module docstring

    def all_gather(self, kind: str, shard_bytes: int, group_size: int) -> None:
        self.add(kind, shard_bytes * (group_size - 1))

    def reduce_scatter(self, kind: str, input_bytes: int, group_size: int) -> None:
        self.add(kind, input_bytes * (group_size - 1) / group_size)

    def all_reduce(self, kind: str, nbytes: int, group_size: int) -> None:
        self.add(kind, 2 * nbytes * (group_size - 1) / group_size)

    def all_to_all(self, kind: str, input_splits: Sequence[int], own: int, unit_bytes: int) -> None:
        """`input_splits[p]` units of `unit_bytes` to each rank p of the group, this one (`own`) not counted."""
        self.add(kind, (sum(input_splits) - input_splits[own]) * unit_bytes)


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: Tensor, group, counter: CommCounter | None, kind: str, op=None) -> None:
    """`dist.all_reduce` (sum unless `op`), counted."""
    dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    if counter is not None:
        counter.all_reduce(kind, _bytes(tensor), dist.get_world_size(group))


def all_to_all_single(
    output: Tensor, input: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group,
    counter: CommCounter | None, kind: str,
) -> None:
    """`dist.all_to_all_single` with explicit (possibly uneven) splits, in elements; counted. gloo rejects
    uneven splits in the list form of all-to-all, not in this one."""
    dist.all_to_all_single(output, input, list(output_splits), list(input_splits), group=group)
    if counter is not None:
        counter.all_to_all(kind, input_splits, dist.get_rank(group), input.element_size())


def broadcast(tensor: Tensor, src: int, group, counter: CommCounter | None, kind: str) -> None:
    """`dist.broadcast` from group rank `src`, counted as a pipelined chain broadcast sends it."""
    size = dist.get_world_size(group)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    if counter is not None and dist.get_rank(group) != (src - 1) % size:
        counter.add(kind, _bytes(tensor))


def ring_shift(tensor: Tensor, incoming: Tensor, group, counter: CommCounter | None, kind: str,
               tag: int = 0) -> list:
    """Post: send `tensor` to the next rank of `group` and receive the previous rank's into `incoming`; an
    empty tensor is neither sent nor awaited (its peer knows its size). Counted; returns the requests."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = []
    if tensor.numel():
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, (rank + 1) % size),
                              group, tag))
        if counter is not None:
            counter.add(kind, _bytes(tensor))
    if incoming.numel():
        ops.append(dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, (rank - 1) % size), group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


if DefaultAllGather is not None:

    class CountingAllGather(DefaultAllGather):
        """FSDP2's default all-gather, counted (its input is this rank's shard)."""

        def __init__(self, counter: CommCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group, async_op: bool = False):
            self.counter.all_gather("fsdp_all_gather", _bytes(input_tensor), dist.get_world_size(group))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        """FSDP2's default reduce-scatter, counted (its input is the unsharded gradient)."""

        def __init__(self, counter: CommCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group, op, async_op: bool = False):
            self.counter.reduce_scatter("fsdp_reduce_scatter", _bytes(input_tensor), dist.get_world_size(group))
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def count_fsdp(module: torch.nn.Module, counter: CommCounter, replicate_size: int) -> bool:
    """Count the traffic of one `fully_shard`-ed module (all-gathers, reduce-scatters and, with HSDP across
    `replicate_size` replicas, the all-reduce of the reduced shards). Returns False where this torch has no
    hooks for it."""
    if DefaultAllGather is None:
        return False
    module.set_custom_all_gather(CountingAllGather(counter))
    module.set_custom_reduce_scatter(CountingReduceScatter(counter))
    if replicate_size > 1:
        module.set_all_reduce_hook(
            lambda reduced: counter.all_reduce("fsdp_all_reduce", _bytes(reduced), replicate_size)
        )
    return True
