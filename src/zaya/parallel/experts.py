"""Expert parallelism: each rank keeps E/ep of a block's experts and the routed tokens travel to them.

`shard_experts` replaces every block's `Experts` (before `parallelize`, usually on the meta device) by
`ParallelExperts`, which holds rank k's experts [k L, (k + 1) L), L = E / ep, under the same parameter names.
Its forward, for the N tokens of this rank (routes in 0..E, E the skip route):

    counts[e]        tokens of this rank routed to expert e (the skip route's are not sent)
    received[p, l]   tokens rank p sends to local expert l: one all-to-all of the counts
    dispatch         the tokens, sorted by expert, to their experts' ranks: one all_to_all_single, uneven;
                     the tokens routed to this rank's own experts stay
    experts          the received rows through the local experts (`Experts.forward`: grouped matmuls)
    combine          each output back to its token's rank: the reverse all_to_all_single
    m                g * output, in token order; 0 for skipped tokens

The split sizes are read to the host once per layer (the counts and the received counts in one read); that is
the layer's one host sync. Only the routed tokens travel, in the autocast dtype (bf16 under bf16): per MoE
layer and direction a rank sends rows x D x bytes, less what stays on it.

Overlap: the tokens that stay are computed while the others travel, half of them during the dispatch and half
during the combine. The exchanges are the functional collectives, started in one place (`_send`) and waited
for in another (`_Receive`); their backward runs the same two exchanges in reverse, started in `_Receive`'s
backward and waited for in `_Hold`'s, and the autograd engine, which of the nodes ready runs those made later
first, runs the staying tokens' backward in between. With ep = 8 and even routing 1/8 of the rows stay; the share of the
exchange they hide is `zaya plan`'s to predict (docs/distributed.md). Compiled
(`zaya.parallel.fsdp.compile_around_experts`), the forward is one graph with the same order (inductor keeps
it, backward included): the split sizes enter it as sizes it cannot know (bounded by `torch._check`), and no
counter sees the exchanges' bytes.

The experts' gradients on a rank sum over the tokens of its whole expert group (they were routed there); FSDP2
averages them over the ranks that hold the same experts, and `finish_gradients` divides by ep, so that they are
averages over every data-parallel rank as every other gradient is. A checkpoint sees each stack whole,
[E, ...], on `ExpertMesh.state_mesh` (`global_state`), so it reshards to any ep and to one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zaya.device import autocast_dtype
from zaya.errors import ZayaError
from zaya.model.moe import Experts, expert_counts
from zaya.model.transformer import Zaya
from zaya.parallel.comm import CommCounter
from zaya.parallel.config import experts_split_problem
from zaya.parallel.dtensor import is_dtensor, local
from zaya.parallel.mesh import ExpertMesh

KIND = "experts"  # the bytes the exchanges send, as the counter names them


class ParallelExperts(Experts):
    """Rank `mesh.rank`'s share of a block's `total` experts, and the token exchange (module docstring).
    `overlap=False` waits for each exchange where it starts: the same work in the order without overlap, to
    measure the overlap against (`benchmarks/ep_overlap.py`)."""

    def __init__(self, whole: Experts, mesh: ExpertMesh, counter: CommCounter | None = None, overlap: bool = True):
        nn.Module.__init__(self)
        self.total = whole.num_experts
        self.num_experts = self.total // mesh.size
        self.first = mesh.rank * self.num_experts
        self.mesh, self.counter, self.overlap = mesh, counter, overlap
        self.use_grouped_mm = whole.use_grouped_mm
        for name in ("gate_up_proj", "down_proj"):  # this rank's experts (on the meta device: their shapes)
            rows = getattr(whole, name).detach()[self.first:self.first + self.num_experts]
            setattr(self, name, nn.Parameter(rows.clone()))

    def forward(self, x_ND: torch.Tensor, route_N: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
        ranks, experts, me, (N, D) = self.mesh.size, self.num_experts, self.mesh.rank, x_ND.shape
        compiling = torch.compiler.is_compiling()
        x_ND = x_ND.to(autocast_dtype(x_ND.device) or x_ND.dtype)  # half the bytes travel under bf16
        order_N = torch.argsort(route_N, stable=True)  # by expert; the skip route (E) last
        counts = expert_counts(route_N, self.total + 1)[:self.total]
        received = funcol.all_to_all_single(counts, [experts] * ranks, [experts] * ranks, self.mesh.group)
        if self.counter is not None and not compiling:
            self.counter.all_to_all(KIND, [experts] * ranks, me, counts.element_size())
        sizes = torch.cat([counts.view(ranks, experts).sum(1), received]).tolist()  # the layer's one host read
        for size in sizes:  # in a graph, sizes it cannot know: what they are bounded by
            torch._check(size >= 0)
        send, from_each = sizes[:ranks], sizes[ranks:]
        receive = [sum(from_each[p * experts:(p + 1) * experts]) for p in range(ranks)]
        torch._check(sum(send) <= N)
        # the tokens routed to this rank's own experts stay: half of them computed while the others travel
        # out, half while their outputs travel back
        by_rank = list(order_N[:sum(send)].split(send))
        home, away = by_rank.pop(me), torch.cat(by_rank)
        halves = [send[me] // 2, send[me] - send[me] // 2]
        send[me] = receive[me] = 0
        home_1, home_2 = home.split(halves)
        expert_1, expert_2 = (route_N.index_select(0, home) - self.first).split(halves)

        x_recv = self._send(x_ND.index_select(0, away), receive, send)
        y_1 = self._home(x_ND, home_1, expert_1, compiling)
        x_recv = self._received(x_recv)
        # the received rows come by sender, then by expert: each row's local expert
        others = received.view(ranks, experts) * (torch.arange(ranks, device=x_ND.device) != me)[:, None]
        local = torch.arange(experts, device=x_ND.device).repeat(ranks)
        expert_R = torch.repeat_interleave(local, others.view(-1), output_size=x_recv.shape[0])
        y_away = self._send(self._run(x_recv, expert_R, compiling), send, receive)
        y_2 = self._home(x_ND, home_2, expert_2, compiling)
        y_away = self._received(y_away)
        y_ND = y_away.new_zeros(N, D).index_copy(0, torch.cat([home, away]), torch.cat([y_1, y_2, y_away]))
        return y_ND if weight_N is None else y_ND * weight_N[:, None].to(y_ND.dtype)

    def _run(self, x_RD: torch.Tensor, expert_R: torch.Tensor, compiling: bool) -> torch.Tensor:
        # a graph takes the grouped matmuls for any number of rows; eagerly few rows may take another way
        return self.grouped(x_RD, expert_R) if compiling else super().forward(x_RD, expert_R, None)

    def _home(self, x_ND: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, compiling: bool):
        """The local experts' outputs for the tokens `token` that stay on this rank (none: nothing to run)."""
        if not compiling and token.shape[0] == 0:
            return x_ND.new_empty(0, x_ND.shape[1])
        return self._run(x_ND.index_select(0, token), expert, compiling)

    def _send(self, rows: torch.Tensor, output_splits: list, input_splits: list) -> tuple | torch.Tensor:
        """Start sending `rows` to the group's ranks (`input_splits[p]` rows to rank p; `output_splits[p]` come
        from it); `_received` waits for them (without overlap they are waited for here, and come back received).
        Eagerly the bytes are counted, both ways (a graph's no counter sees)."""
        count = None if self.counter is None or torch.compiler.is_compiling() else self._count
        if count:
            count(rows, input_splits)
        rows = _Hold.apply(rows)
        sent = (_start(rows.detach(), output_splits, input_splits, self.mesh.group.group_name), rows,
                (output_splits, input_splits), self.mesh.group.group_name, count)
        return sent if self.overlap else self._received(sent)

    def _received(self, sent: tuple | torch.Tensor) -> torch.Tensor:
        """The rows an exchange `_send` started brings, once they are here."""
        return sent if isinstance(sent, torch.Tensor) else _Receive.apply(*sent)

    def _count(self, rows: torch.Tensor, input_splits: list) -> None:
        self.counter.all_to_all(KIND, input_splits, self.mesh.rank, rows.shape[1] * rows.element_size())


def _start(rows: torch.Tensor, output_splits: list, input_splits: list, group_name: str) -> torch.Tensor:
    """The functional all-to-all, not waited for: its output may be read only after `wait_tensor`."""
    return torch.ops._c10d_functional.all_to_all_single(rows.contiguous(), output_splits, input_splits, group_name)


class _Hold(torch.autograd.Function):
    """The rows an exchange sends, as they are; in backward it waits for their gradients, which `_Receive`'s
    backward started sending. Between the two the autograd engine runs what was computed between them in
    forward (of the nodes ready it runs those made later first), so the staying tokens' backward overlaps the
    gradients' exchange as their forward overlapped the rows'."""

    @staticmethod
    def forward(ctx, rows):
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(grad)


class _Receive(torch.autograd.Function):
    """The exchange's received rows (`started`, once they are here), as a function of the rows sent; in backward
    it starts sending their gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, started, rows, splits, group_name, count):
        ctx.splits, ctx.group_name, ctx.count = splits, group_name, count
        return funcol.wait_tensor(started)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        if ctx.count:
            ctx.count(grad, output_splits)
        return None, _start(grad, input_splits, output_splits, ctx.group_name), None, None, None


def shard_experts(model: Zaya, mesh: ExpertMesh, counter: CommCounter | None = None) -> Zaya:
    """Give every block `ParallelExperts` in place of its experts (before `parallelize`; on the meta device, or
    with values: each rank keeps its experts' values); returns the model."""
    problem = experts_split_problem(model.config.num_experts, mesh.size)
    if problem:
        raise ZayaError(problem)
    for block in model.blocks:
        block.moe.experts = ParallelExperts(block.moe.experts, mesh, counter)
    return model


@torch.no_grad()
def finish_gradients(params: Iterable[torch.Tensor], mesh: ExpertMesh) -> None:
    """After the step's last backward, for the optimizer's `params` (the shards: under ZeRO-1 the model's
    registered parameters are the whole ones): FSDP2 averaged the experts' gradients over the ranks holding the
    same experts, but they are sums over the tokens of a whole expert group, as many as `mesh.size` ranks read;
    divided by that, they are averages over every data-parallel rank like the other gradients."""
    grads = [local(p.grad) for p in params if p.grad is not None and expert_span(p, mesh) is not None]
    grads = [g for g in grads if g.numel()]
    if grads:
        torch._foreach_div_(grads, float(mesh.size))


def expert_span(param: torch.Tensor, experts: ExpertMesh) -> object:
    """For `zaya.parallel.dtensor.total_norm`: the group whose ranks hold the other experts of `param`'s stack
    (None for a parameter that is no expert stack)."""
    return experts.group if is_dtensor(param) and param.device_mesh == experts.fsdp_mesh else None


def parallel_experts(model: nn.Module) -> Iterator[ParallelExperts]:
    return (module for module in model.modules() if isinstance(module, ParallelExperts))


def whole_shapes(model: nn.Module) -> dict[int, tuple[tuple[int, ...], int]]:
    """For `zaya.parallel.materialize`: each expert stack of this rank (by id) with the shape of the whole stack
    and the first expert it holds, so that it gets its experts' values of the whole stack's draw."""
    parts = {}
    for experts in parallel_experts(model):
        for param in (experts.gate_up_proj, experts.down_proj):
            parts[id(param)] = ((experts.total, *param.shape[1:]), experts.first)
    return parts


def global_state(state: dict, mesh: ExpertMesh) -> dict:
    """`state` (nested dicts of tensors: a model's or an optimizer's state dict) with every tensor on the experts'
    FSDP mesh shown whole, as a DTensor [E, ...] on `mesh.state_mesh` over the same local shard (no copy: loading
    into it loads into the original)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = global_state(value, mesh)
        elif is_dtensor(value) and value.device_mesh == mesh.fsdp_mesh:
            out[key] = _whole(value, mesh)
        else:
            out[key] = value
    return out


def _whole(tensor: DTensor, mesh: ExpertMesh) -> DTensor:
    split = next(p for p in tensor.placements if isinstance(p, Shard))
    placements = [Shard(0), split]
    if mesh.state_mesh.ndim == 3:
        placements.insert(0, Replicate())
    shape = (tensor.shape[0] * mesh.size, *tensor.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(tensor.to_local(), mesh.state_mesh, placements, run_check=False, shape=shape,
                              stride=stride)


@dataclass(frozen=True)
class ExpertViews:
    """How a model with `ParallelExperts` meets state dicts of the whole model (checkpoints, HF weights):
    `whole` shows its expert stacks (and their optimizer state) as [E, ...] DTensors to load into or save;
    `rows` cuts a whole model's expert stacks to this rank's experts."""

    mesh: ExpertMesh
    slices: dict[str, tuple[int, int]]  # parameter name: (first expert, experts) of this rank

    @classmethod
    def of(cls, model: nn.Module, mesh: ExpertMesh) -> ExpertViews:
        slices = {f"{name}.{param}": (module.first, module.num_experts)
                  for name, module in model.named_modules() if isinstance(module, ParallelExperts)
                  for param in ("gate_up_proj", "down_proj")}
        return cls(mesh, slices)

    def whole(self, state: dict) -> dict:
        return global_state(state, self.mesh)

    def rows(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value.narrow(0, *self.slices[key]) if key in self.slices else value
                for key, value in full.items()}
