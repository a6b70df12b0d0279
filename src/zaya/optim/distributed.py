"""Distributed Muon: under FSDP2 every matrix is orthogonalised exactly once per step, by one rank.

The momentum is elementwise and runs on every rank's shard (`zaya.optim.muon`). The Newton-Schulz iteration
needs whole matrices:

- a shard that holds whole matrices (a stack of experts split along the expert dimension) is orthogonalised
  where it lies, with no communication;
- every other matrix (a 2-D weight split by rows, or each matrix of an expert stack split along its rows)
  has an owner rank. Every rank sends the owner its rows of the momentum-updated matrix U; the owner joins
  them, normalises and iterates the matrix exactly as single-process Muon would, and sends each rank its rows
  of the result, which each rank applies to its shard.

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
from torch import Tensor

from zaya.optim.ns_iteration import NS_DTYPES, Batch, Workspace, as_stack, newton_schulz_flops, normalize_into
from zaya.parallel.comm import CommCounter, all_to_all_single
from zaya.parallel.dtensor import ShardLayout, chunk_bounds, local


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
def plan_owners(layouts: tuple[MatrixLayout, ...], world: int) -> OwnerPlan:
    """The owners of the split matrices among `world` ranks (see the module docstring). `layouts` lists every
    Muon parameter of one process group in step order; the plan is a pure function of them."""
    loads = [0.0] * world
    units = []
    for index, layout in enumerate(layouts):
        cost = newton_schulz_flops(*layout.shape[-2:])
        if layout.dim is None:  # orthogonalised by every rank alike
            loads = [load + layout.count * cost for load in loads]
        elif layout.local_matrices:
            for rank in range(world):
                start, stop = chunk_bounds(layout.count, world, rank)
                loads[rank] += (stop - start) * cost
        else:
            units += [(cost, index, matrix) for matrix in range(layout.count)]
    owners = []
    for cost, index, matrix in sorted(units, key=lambda unit: (-unit[0], unit[1], unit[2])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += cost
        owners.append((index, matrix, rank))
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
    """A Muon parameter whose shards split its matrices, with what its step needs. `index` is its position
    among the step's parameters (the same on every rank)."""

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
    def axis(self) -> int:
        """The axis of each matrix [m, n] that the shards split (0: rows, 1: columns)."""
        return self.layout.dim - (self.param.ndim - 2)

    def matrix(self, tensor: Tensor, matrix: int) -> Tensor:
        """Matrix `matrix` of a local tensor of this parameter ([m', n'] of [m', n'] or [E, m', n'])."""
        return tensor if tensor.ndim == 2 else tensor[matrix]

    def piece_numel(self, rank: int) -> int:
        """Elements of one matrix that `rank` holds."""
        m, n = self.param.shape[-2:]
        start, stop = self.layout.bounds((m, n)[self.axis], rank)
        return (stop - start) * ((n, m)[self.axis])


def owner_step(
    records: Sequence[tuple[int, MatrixLayout, ShardLayout, SplitMatrices | None]],
    workspace: Workspace | None,
    counter: CommCounter | None,
    report: MuonReport,
) -> None:
    """The owner-rank part of a Muon step. `records` has one entry per DTensor Muon parameter of the step:
    (index, its layout for the plan, its shard layout, and for a split one its `SplitMatrices`); parameters
    whose shards hold whole matrices have already been stepped and only weigh in the plan."""
    by_group: dict[object, list] = {}
    for record in records:
        if record[2].group is not None:
            by_group.setdefault(record[2].group, []).append(record)
    for members in by_group.values():
        _group_step(members, workspace, counter, report)


def _group_step(records: list, workspace: Workspace | None, counter: CommCounter | None, report: MuonReport) -> None:
    split = {index: entry for index, _, _, entry in records if entry is not None}
    if not split:
        return
    shard = next(iter(split.values())).layout
    world, me = shard.size, shard.index
    plan = plan_owners(tuple(layout for _, layout, _, _ in records), world)
    position = [index for index, _, _, _ in records]  # plan index -> parameter index
    units = [(split[position[i]], matrix, owner) for i, matrix, owner in plan.owners]

    # momentum on the local shards, then U of every split matrix to its owner
    directions = {}
    for entry in split.values():
        g, b = local(entry.grad), local(entry.buffer)
        b.lerp_(g, 1 - entry.momentum)
        directions[entry.index] = torch.lerp(g, b, entry.momentum) if entry.nesterov else b
    dtype = functools.reduce(torch.promote_types, (u.dtype for u in directions.values()))
    device = next(iter(directions.values())).device
    sends = [[] for _ in range(world)]
    for entry, matrix, owner in units:
        sends[owner].append(entry.matrix(directions[entry.index], matrix).reshape(-1))
    send_splits = [sum(piece.numel() for piece in pieces) for pieces in sends]
    mine = [(entry, matrix) for entry, matrix, owner in units if owner == me]
    recv_splits = [sum(entry.piece_numel(rank) for entry, _ in mine) for rank in range(world)]
    send = torch.cat([piece.to(dtype) for pieces in sends for piece in pieces]) if any(send_splits) else \
        torch.empty(0, dtype=dtype, device=device)
    received = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    all_to_all_single(received, send, recv_splits, send_splits, shard.group, counter, "muon_gather")
    sent = (sum(send_splits) - send_splits[me]) * dtype.itemsize

    # the owner's matrices, iterated in batches of one shape, each rank's rows of the result sent back
    pieces_from = _split_by_source(received, recv_splits, mine)
    batches: dict[tuple, Batch] = {}
    for slot, (entry, matrix) in enumerate(mine):
        m, n = entry.param.shape[-2:]
        full = torch.cat(pieces_from[slot], dim=entry.axis)
        batches.setdefault((m, n, entry.settings), Batch(m, n, device)).items.append(_Owned(full, slot))
        report.add(entry.index, matrix, 1, m, n)
    results: dict[int, Tensor] = {}

    def keep(item: _Owned, start: int, stop: int, result: Tensor) -> None:
        results[item.slot] = result[0].clone()  # the batch reuses its chunk's memory

    for (_, _, ((steps, coefficients, eps, dtype_name), backend)), batch in batches.items():
        batch.run(steps, coefficients, eps, NS_DTYPES[dtype_name], backend, keep, workspace)
    out_dtype = functools.reduce(torch.promote_types, (NS_DTYPES[e.settings[0][3]] for e in split.values()))
    back = _pack_results(results, mine, world, out_dtype, device)
    returned = torch.empty(sum(send_splits), dtype=out_dtype, device=device)
    all_to_all_single(returned, back, send_splits, recv_splits, shard.group, counter, "muon_scatter")
    report.sent_bytes += sent + (sum(recv_splits) - recv_splits[me]) * out_dtype.itemsize

    # each rank's rows of every result, applied to its shard
    offset = 0
    for owner in range(world):
        for entry, matrix, unit_owner in units:
            if unit_owner != owner:
                continue
            weight = entry.matrix(local(entry.param), matrix)
            count = weight.numel()
            if count:
                update = returned[offset:offset + count].view(weight.shape)
                if entry.decay != 1:
                    weight.mul_(entry.decay)
                weight.add_(update, alpha=-entry.rate)
            offset += count


def _split_by_source(received: Tensor, splits: list[int], mine: list) -> list[list[Tensor]]:
    """For each matrix this rank owns, its pieces from ranks 0, 1, ... (views into `received`)."""
    pieces: list[list[Tensor]] = [[] for _ in mine]
    offset = 0
    for rank in range(len(splits)):
        for slot, (entry, _) in enumerate(mine):
            count = entry.piece_numel(rank)
            m, n = entry.param.shape[-2:]
            other = (n, m)[entry.axis]
            view = received[offset:offset + count]
            pieces[slot].append(view.view(-1, other) if entry.axis == 0 else view.view(other, -1))
            offset += count
    return pieces


@dataclass
class _Owned:
    """A matrix this rank owns, joined from its pieces; normalised into the batch as single-process Muon does."""

    full: Tensor
    slot: int

    @property
    def shape(self) -> torch.Size:
        return self.full.shape

    @property
    def device(self) -> torch.device:
        return self.full.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        normalize_into(as_stack(self.full)[start:stop], out_BMN, eps, overwrite=True)


def _pack_results(results: dict, mine: list, world: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Each rank's rows of every owned result, rank by rank, in the order the ranks expect them."""
    pieces = []
    for rank in range(world):
        for slot, (entry, _) in enumerate(mine):
            m, n = entry.param.shape[-2:]
            start, stop = entry.layout.bounds((m, n)[entry.axis], rank)
            result = results[slot]
            part = result[start:stop] if entry.axis == 0 else result[:, start:stop]
            pieces.append(part.reshape(-1).to(dtype))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
