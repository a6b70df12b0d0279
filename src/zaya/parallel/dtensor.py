"""What the optimizer and the trainer need to know about a sharded parameter (an FSDP2 `DTensor`): its local
shard, the process group it is split over, and which rows each rank of that group holds.

FSDP2 splits a tensor along one dimension as `torch.chunk` does: chunks of ceil(L / N) rows, the last ones
shorter or empty. Elementwise work (momentum, AdamW, clipping's scale) runs on the local shards as it is;
only reductions over whole tensors (a gradient norm, a matrix's orthogonalisation) need the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zaya.errors import ZayaError

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Shard
except ImportError:  # a torch build without torch.distributed: nothing is ever sharded
    DTensor = None


def is_dtensor(tensor: Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place work on it changes the DTensor), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class ShardLayout:
    """How a tensor is split: along `dim` over the `size` ranks of `group`, this rank being `index` in it.
    `dim` is None when every rank holds the whole tensor (a plain tensor, or a DTensor replicated or split
    over a one-rank mesh dimension only). Under HSDP the same shards repeat on `replicas` replicas, this rank
    in replica `replica`; `slots` then lists the global ranks of the whole mesh, replica by replica and shard
    by shard within each (slot r * size + index is replica r's shard index)."""

    dim: int | None
    size: int = 1
    index: int = 0
    group: object = None
    replicas: int = 1
    replica: int = 0
    slots: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        return self.dim is None

    @property
    def slot(self) -> int:
        """This rank's place among the replicas' shards: replica x size + index."""
        return self.replica * self.size + self.index

    @property
    def key(self) -> object:
        """Tensors of one key are split alike over the same ranks (the optimizer steps them together)."""
        return (self.group, self.slots) if self.replicas > 1 else self.group

    def bounds(self, length: int, index: int | None = None) -> tuple[int, int]:
        """The rows [start, stop) of a dimension of `length` that rank `index` (default: this one) holds."""
        return chunk_bounds(length, self.size, self.index if index is None else index)


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk `index` when `length` rows are cut as `torch.chunk` cuts them into `parts`."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def shard_layout(tensor: Tensor) -> ShardLayout:
    """The layout of `tensor`; a tensor split over more than one mesh dimension, or holding partial sums, is
    not something the optimizer can reduce and is refused."""
    if not is_dtensor(tensor):
        return ShardLayout(None)
    mesh = tensor.device_mesh
    found, shard_dim, replicate_dim = ShardLayout(None), None, None
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Partial):
            raise ZayaError(f"a parameter of shape {list(tensor.shape)} holds partial sums ({placement}); "
                            "reduce it before the optimizer step")
        if mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Shard):
            if shard_dim is not None:
                raise ZayaError(f"a parameter of shape {list(tensor.shape)} is split over two mesh dimensions "
                                f"({tensor.placements}); the optimizer takes one")
            shard_dim = mesh_dim
            found = ShardLayout(placement.dim, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim),
                                mesh.get_group(mesh_dim))
        elif replicate_dim is not None:
            raise ZayaError(f"a parameter of shape {list(tensor.shape)} is replicated over two mesh dimensions "
                            f"({tensor.placements}); the optimizer takes one")
        else:
            replicate_dim = mesh_dim
    if replicate_dim is None:
        return found
    ranks = mesh.mesh.movedim(replicate_dim, 0)
    if shard_dim is not None:
        ranks = ranks.movedim(shard_dim if shard_dim > replicate_dim else shard_dim + 1, 1)
    # every other mesh dimension has one rank: the ranks by (replica, shard)
    slots = tuple(int(r) for r in ranks.reshape(mesh.size(replicate_dim), -1).flatten().tolist())
    return dataclasses.replace(found, replicas=mesh.size(replicate_dim), replica=mesh.get_local_rank(replicate_dim),
                               slots=slots)


_GROUPS: dict[tuple[int, ...], object] = {}


def slots_group(slots: tuple[int, ...]) -> object:
    """A process group of the global ranks `slots` (the default group when they are all the ranks; made once
    otherwise, by its members only)."""
    if sorted(slots) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    if slots not in _GROUPS:
        _GROUPS[slots] = dist.new_group(sorted(slots), use_local_synchronization=True)
    return _GROUPS[slots]


def total_norm(
    tensors: Sequence[Tensor], all_reduce: Callable[[Tensor, object], None] | None = None,
    spans: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """The 2-norm of all `tensors` together, as one fp32 tensor, equal on every rank.

    Whole tensors count once; each group of tensors split over a process group contributes the sum of its
    shards' squares, summed over the group by `all_reduce(tensor, group)` (default `dist.all_reduce`): one
    collective per process group, whatever the number of tensors. `spans(tensor)`, where given and not None, is
    one more group the tensor's square is summed over: the ranks that hold the other parts of a tensor each rank
    holds a part of (an expert stack under expert parallelism)."""
    by_group: dict[tuple, list[Tensor]] = {}
    for tensor in tensors:
        key = (shard_layout(tensor).group, spans(tensor) if spans is not None else None)
        by_group.setdefault(key, []).append(local(tensor))
    squares = []
    for groups, members in by_group.items():
        members = [t for t in members if t.numel()]
        square = (torch.nn.utils.get_total_norm(members, foreach=True).float() ** 2 if members
                  else torch.zeros((), device=tensors[0].device if tensors else "cpu"))
        for group in groups:
            if group is not None:
                (all_reduce or _all_reduce)(square, group)
        squares.append(square)
    if not squares:
        return torch.zeros(())
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(params: Sequence[Tensor], max_norm: float,
                    all_reduce: Callable[[Tensor, object], None] | None = None,
                    spans: Callable[[Tensor], object] | None = None) -> Tensor:
    """Scale the gradients of `params` so that their global norm is at most `max_norm` (0: only measure);
    returns the norm before clipping. `torch.nn.utils.clip_grad_norm_`'s rule, on local shards. `spans(param)`:
    see `total_norm`."""
    grads = [p.grad for p in params if p.grad is not None]
    spans_of = {id(p.grad): spans(p) for p in params if p.grad is not None} if spans is not None else None
    norm = total_norm(grads, all_reduce, None if spans_of is None else lambda g: spans_of[id(g)])
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [g for g in map(local, grads) if g.numel()]
        if locals_:
            torch._foreach_mul_(locals_, scale.to(locals_[0].device))
    return norm


def local_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the local shards of `tensors` (what this rank holds)."""
    return sum(local(t).numel() * t.element_size() for t in tensors)


def _all_reduce(tensor: Tensor, group: object) -> None:
    dist.all_reduce(tensor, group=group)
