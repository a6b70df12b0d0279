"""Distributed Muon: under FSDP2 every matrix is orthogonalised exactly once per step, by one rank.

The momentum is elementwise and runs on every rank's shard (`zaya.optim.muon`). The Newton-Schulz iteration
needs whole matrices:

- a shard that holds whole matrices (a stack of experts split along the expert dimension) is orthogonalised
  where it lies, with no communication;
- every other matrix (a 2-D weight split by rows, or each matrix of an expert stack split along its rows)
  has an owner rank. Every rank sends the owner its rows of the momentum-updated matrix U; the owner joins
  them, normalises and iterates the matrix exactly as single-process Muon would, and sends each rank its rows
  of the result, which each rank applies to its shard.

Under HSDP every replica holds the same shards and, after the gradients' all-reduce, the same U. Owners are
then chosen over every replica's ranks (slot r x S + s of replica r's shard s), so that each rank does about
1/(R S) of the iteration and not 1/S: a split matrix's rows travel to its owner from the shards of the owner's
replica only, a matrix a shard holds whole goes to one replica of that shard and does not travel, and every
result goes back to its rows' holders on every replica. The two all-to-alls then run over the whole
data-parallel group (`zaya.parallel.dtensor.slots_group`).

Owners balance the Newton-Schulz FLOPs per rank, the local work included: the matrices in decreasing order of
cost, each to the least loaded rank (the LPT rule, within 4/3 of the best possible maximum). The plan depends
only on the shapes and the layout, so every rank computes the same one, once (`plan_owners`). Per process
group and step there are two all-to-alls, whatever the number of matrices: U to the owners in its own dtype
(so that the owner's normalisation is bit for bit a single process's) and the result back in the
iteration's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from zaya.optim.ns_iteration import NS_DTYPES, Batch, Workspace, as_stack, newton_schulz_flops, normalize_into
from zaya.parallel.comm import CommCounter, all_to_all_single
from zaya.parallel.dtensor import ShardLayout, chunk_bounds, local, slots_group


@dataclass(frozen=True)
class MatrixLayout:
    """A Muon parameter as the plan sees it: its global shape ([m, n] or a stack [E, m, n]) and the dimension
    its shards are split along (None: every rank holds it whole)."""

    shape: tuple[int, ...]
    dim: int | None

    @property
    def count(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def local_matrices(self) -> bool:
        """Whether each shard holds whole matrices (no split, or a stack split along its first dimension)."""
        return self.dim is None or (len(self.shape) == 3 and self.dim == 0)


@dataclass(frozen=True)
class OwnerPlan:
    """Which rank orthogonalises which split matrix, and the Newton-Schulz FLOPs each rank then does."""

    owners: tuple[tuple[int, int, int], ...]  # (parameter index, matrix index, owner rank), in that order
    loads: tuple[float, ...]  # FLOPs per rank, the whole-matrix shards' included

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank FLOPs (1.0 is a perfect balance)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


@functools.lru_cache(maxsize=32)
def plan_owners(layouts: tuple[MatrixLayout, ...], world: int, replicas: int = 1) -> OwnerPlan:
    """The owners of the matrices among the `replicas` x `world` ranks (see the module docstring). `layouts`
    lists every Muon parameter of one process group in step order; the plan is a pure function of them.
    Owners are slots: replica r's shard s is slot r * world + s. With one replica the matrices a shard holds
    whole stay with it; with more, each goes to one replica of the shard (or shards) holding it."""
    slots = world * replicas
    loads = [0.0] * slots
    units = []
    for index, layout in enumerate(layouts):
        cost = newton_schulz_flops(*layout.shape[-2:])
        if layout.dim is None:  # every shard holds it whole
            if replicas == 1:
                loads = [load + layout.count * cost for load in loads]
            else:
                units += [(cost, index, matrix, range(slots)) for matrix in range(layout.count)]
        elif layout.local_matrices:
            for shard in range(world):
                start, stop = chunk_bounds(layout.count, world, shard)
                if replicas == 1:
                    loads[shard] += (stop - start) * cost
                else:
                    units += [(cost, index, matrix, range(shard, slots, world)) for matrix in range(start, stop)]
        else:
            units += [(cost, index, matrix, range(slots)) for matrix in range(layout.count)]
    owners = []
    for cost, index, matrix, candidates in sorted(units, key=lambda unit: (-unit[0], unit[1], unit[2])):
        slot = min(candidates, key=lambda g: (loads[g], g))
        loads[slot] += cost
        owners.append((index, matrix, slot))
    return OwnerPlan(tuple(sorted(owners)), tuple(loads))


@dataclass
class MuonReport:
    """What this rank orthogonalised in one Muon step: (parameter index, matrix index) of each matrix, their
    Newton-Schulz FLOPs, and the bytes it sent for them."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    flops: int = 0
    sent_bytes: int = 0

    def add(self, index: int, first: int, count: int, rows: int, cols: int) -> None:
        self.keys += [(index, first + i) for i in range(count)]
        self.flops += count * newton_schulz_flops(rows, cols)


@dataclass
class SplitMatrices:
    """A Muon parameter whose matrices go to owners, with what its step needs: one its shards split (each
    rank holds rows or columns of every matrix), or, across HSDP replicas, one whose shards hold whole matrices
    (each goes to one replica of the shard holding it). `index` is its position among the step's parameters
    (the same on every rank)."""

    index: int
    param: Tensor
    grad: Tensor
    buffer: Tensor
    layout: ShardLayout
    momentum: float
    nesterov: bool
    decay: float
    rate: float
    settings: tuple  # (steps, coefficients, eps, dtype name), then the backend

    @property
    def split(self) -> bool:
        """Whether its shards split each matrix (else each shard holds whole matrices)."""
        return not MatrixLayout(tuple(self.param.shape), self.layout.dim).local_matrices

    @property
    def axis(self) -> int:
        """The axis of each matrix [m, n] that the shards split (0: rows, 1: columns)."""
        return self.layout.dim - (self.param.ndim - 2)

    def matrix(self, tensor: Tensor, matrix: int) -> Tensor:
        """This rank's part of matrix `matrix` in a local tensor of this parameter: its rows or columns of it
        ([m', n'] of [m', n'] or [E, m', n']), or the whole matrix where its shard holds it."""
        if tensor.ndim == 2:
            return tensor
        if not self.split and not self.layout.whole:  # a stack split along its matrices
            matrix -= self.layout.bounds(self.param.shape[0])[0]
        return tensor[matrix]

    def holds(self, shard: int, matrix: int) -> bool:
        """Whether shard `shard` holds (part of) matrix `matrix`."""
        if self.split or self.layout.whole:
            return True
        start, stop = chunk_bounds(self.param.shape[0], self.layout.size, shard)
        return start <= matrix < stop

    def piece_numel(self, shard: int, matrix: int) -> int:
        """Elements of matrix `matrix` that shard `shard` holds."""
        m, n = self.param.shape[-2:]
        if not self.split:
            return m * n if self.holds(shard, matrix) else 0
        start, stop = self.layout.bounds((m, n)[self.axis], shard)
        return (stop - start) * ((n, m)[self.axis])


def owner_step(
    records: Sequence[tuple[int, MatrixLayout, ShardLayout, SplitMatrices | None]],
    workspace: Workspace | None,
    counter: CommCounter | None,
    report: MuonReport,
) -> None:
    """The owner-rank part of a Muon step. `records` has one entry per DTensor Muon parameter of the step:
    (index, its layout for the plan, its shard layout, and for one that goes to owners its `SplitMatrices`);
    parameters whose shards hold whole matrices on a single replica have already been stepped and only weigh
    in the plan."""
    by_group: dict[object, list] = {}
    for record in records:
        if record[2].group is not None or record[2].replicas > 1:
            by_group.setdefault(record[2].key, []).append(record)
    for members in by_group.values():
        _group_step(members, workspace, counter, report)


class _Ranks:
    """The ranks a group's matrices travel between: its shards, or with HSDP every replica's shards (slots
    r * shards + s), and the process group that connects them, indexed by group rank."""

    def __init__(self, layout: ShardLayout) -> None:
        self.shards, self.replicas = layout.size, layout.replicas
        self.me = layout.slot
        if layout.replicas == 1:
            self.group, self.order = layout.group, list(range(layout.size))
        else:
            self.group = slots_group(layout.slots)
            # slot of each group rank
            by_rank = {dist.get_group_rank(self.group, rank): slot for slot, rank in enumerate(layout.slots)}
            self.order = [by_rank[rank] for rank in range(len(layout.slots))]

    @property
    def count(self) -> int:
        return self.shards * self.replicas

    def shard(self, slot: int) -> int:
        return slot % self.shards

    def replica(self, slot: int) -> int:
        return slot // self.shards


def _group_step(records: list, workspace: Workspace | None, counter: CommCounter | None, report: MuonReport) -> None:
    split = {index: entry for index, _, _, entry in records if entry is not None}
    if not split:
        return
    ranks = _Ranks(next(iter(split.values())).layout)
    me = ranks.me
    plan = plan_owners(tuple(layout for _, layout, _, _ in records), ranks.shards, ranks.replicas)
    position = [index for index, _, _, _ in records]  # plan index -> parameter index
    units = [(split[position[i]], matrix, owner) for i, matrix, owner in plan.owners]

    def gathered(entry: SplitMatrices, matrix: int, owner: int, slot: int) -> int:
        """Elements `slot` sends `owner` of a matrix: its rows from the owner's replica (a whole matrix never
        travels to its owner, which holds it)."""
        if not entry.split or ranks.replica(slot) != ranks.replica(owner):
            return 0
        return entry.piece_numel(ranks.shard(slot), matrix)

    def returned(entry: SplitMatrices, matrix: int, slot: int) -> int:
        """Elements of the result `slot` gets back: its part of the matrix, on every replica."""
        return entry.piece_numel(ranks.shard(slot), matrix)

    # momentum on the local shards, then U of every split matrix to its owner
    directions = {}
    for entry in split.values():
        g, b = local(entry.grad), local(entry.buffer)
        b.lerp_(g, 1 - entry.momentum)
        directions[entry.index] = torch.lerp(g, b, entry.momentum) if entry.nesterov else b
    dtype = functools.reduce(torch.promote_types, (u.dtype for u in directions.values()))
    device = next(iter(directions.values())).device
    sends: list[list[Tensor]] = [[] for _ in range(ranks.count)]
    for entry, matrix, owner in units:
        if gathered(entry, matrix, owner, me):
            sends[owner].append(entry.matrix(directions[entry.index], matrix).reshape(-1))
    mine = [(entry, matrix) for entry, matrix, owner in units if owner == me]
    send_splits = [sum(piece.numel() for piece in pieces) for pieces in sends]
    recv_splits = [sum(gathered(entry, matrix, me, slot) for entry, matrix in mine) for slot in range(ranks.count)]
    send = _in_rank_order(sends, ranks.order, dtype, device)
    received = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    all_to_all_single(received, send, [recv_splits[s] for s in ranks.order], [send_splits[s] for s in ranks.order],
                      ranks.group, counter, "muon_gather")
    sent = (sum(send_splits) - send_splits[me]) * dtype.itemsize

    # the owner's matrices, joined from their pieces (or whole where it holds them), iterated in batches of
    # one shape; each rank's part of each result sent back, to every replica
    offsets = _offsets([recv_splits[s] for s in ranks.order], ranks.order)
    batches: dict[tuple, Batch] = {}
    for position, (entry, matrix) in enumerate(mine):
        m, n = entry.param.shape[-2:]
        if entry.split:
            pieces = []
            for source in range(ranks.count):
                count = gathered(entry, matrix, me, source)
                if count:
                    view = received[offsets[source]:offsets[source] + count]
                    other = (n, m)[entry.axis]
                    pieces.append(view.view(-1, other) if entry.axis == 0 else view.view(other, -1))
                    offsets[source] += count
            full = torch.cat(pieces, dim=entry.axis)
        else:
            full = entry.matrix(directions[entry.index], matrix)
        batches.setdefault((m, n, entry.settings), Batch(m, n, device)).items.append(_Owned(full, position))
        report.add(entry.index, matrix, 1, m, n)
    results: dict[int, Tensor] = {}

    def keep(item: _Owned, start: int, stop: int, result: Tensor) -> None:
        results[item.position] = result[0].clone()  # the batch reuses its chunk's memory

    for (_, _, ((steps, coefficients, eps, dtype_name), backend)), batch in batches.items():
        batch.run(steps, coefficients, eps, NS_DTYPES[dtype_name], backend, keep, workspace)
    out_dtype = functools.reduce(torch.promote_types, (NS_DTYPES[e.settings[0][3]] for e in split.values()))
    backs: list[list[Tensor]] = [[] for _ in range(ranks.count)]
    for target in range(ranks.count):
        for position, (entry, matrix) in enumerate(mine):
            if returned(entry, matrix, target):
                backs[target].append(_part(entry, results[position], ranks.shard(target)).reshape(-1).to(out_dtype))
    back_splits = [sum(piece.numel() for piece in pieces) for pieces in backs]
    expect = [sum(returned(entry, matrix, me) for entry, matrix, unit_owner in units if unit_owner == owner)
              for owner in range(ranks.count)]
    back = _in_rank_order(backs, ranks.order, out_dtype, device)
    got = torch.empty(sum(expect), dtype=out_dtype, device=device)
    all_to_all_single(got, back, [expect[s] for s in ranks.order], [back_splits[s] for s in ranks.order],
                      ranks.group, counter, "muon_scatter")
    report.sent_bytes += sent + (sum(back_splits) - back_splits[me]) * out_dtype.itemsize

    # this rank's part of every result, applied to its shard
    offsets = _offsets([expect[s] for s in ranks.order], ranks.order)
    for entry, matrix, owner in units:
        count = returned(entry, matrix, me)
        if count:
            weight = entry.matrix(local(entry.param), matrix)
            update = got[offsets[owner]:offsets[owner] + count].view(weight.shape)
            if entry.decay != 1:
                weight.mul_(entry.decay)
            weight.add_(update, alpha=-entry.rate)
            offsets[owner] += count


def _in_rank_order(pieces: list[list[Tensor]], order: list[int], dtype: torch.dtype, device) -> Tensor:
    """The pieces for each slot, joined in the order of the group's ranks (`order[rank]` is its slot)."""
    flat = [piece.to(dtype) for slot in order for piece in pieces[slot]]
    return torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)


def _offsets(sizes_by_rank: list[int], order: list[int]) -> dict[int, int]:
    """Where each slot's part starts in a buffer laid out by group rank."""
    offsets, offset = {}, 0
    for rank, size in enumerate(sizes_by_rank):
        offsets[order[rank]] = offset
        offset += size
    return offsets


def _part(entry: SplitMatrices, result: Tensor, shard: int) -> Tensor:
    """Shard `shard`'s part of an orthogonalised matrix: its rows or columns of it, or all of it."""
    if not entry.split:
        return result
    m, n = entry.param.shape[-2:]
    start, stop = entry.layout.bounds((m, n)[entry.axis], shard)
    return result[start:stop] if entry.axis == 0 else result[:, start:stop]


@dataclass
class _Owned:
    """A matrix this rank owns, joined from its pieces; normalised into the batch as single-process Muon does."""

    full: Tensor
    position: int  # among the matrices this rank owns

    @property
    def shape(self) -> torch.Size:
        return self.full.shape

    @property
    def device(self) -> torch.device:
        return self.full.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        normalize_into(as_stack(self.full)[start:stop], out_BMN, eps, overwrite=True)
