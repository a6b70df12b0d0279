"""Expert parallelism: each rank keeps E/ep of a block's experts and the routed tokens travel to them.

`shard_experts` replaces every block's `Experts` (before `parallelize`, usually on the meta device) by
`ParallelExperts`, which holds rank k's experts [k L, (k + 1) L), L = E / ep, under the same parameter names.
Its forward, for the N tokens of this rank (routes in 0..E, E the skip route):

    counts[e]        tokens of this rank routed to expert e (the skip route's are not sent)
    received[p, l]   tokens rank p sends to local expert l: one all-to-all of the counts
    dispatch         the tokens, sorted by expert, to their experts' ranks: one all_to_all_single, uneven
    experts          the received rows through the local experts (`Experts.forward`: grouped matmuls)
    combine          each output back to its token's rank: the reverse all_to_all_single
    m                g * output, in token order; 0 for skipped tokens

The split sizes are read to the host once per layer (the counts and the received counts in one read); that is
the layer's one host sync. The backward runs the same two exchanges in reverse (`_Exchange`). Only the routed
tokens travel, in the autocast dtype (bf16 under bf16): per MoE layer and direction a rank sends
rows x D x bytes, less what stays on it. Compiled (`zaya.parallel.fsdp.compile_around_experts`), the forward
is one graph: the split sizes enter it as sizes it cannot know (bounded by `torch._check`), the exchanges are
the traceable functional collectives (their backward the reverse exchange too), and no counter sees their
bytes.

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
from zaya.parallel.comm import CommCounter, all_to_all_single
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
        if compiling:
            received = funcol.all_to_all_single(counts, [experts] * ranks, [experts] * ranks, self.mesh.group)
        else:
            received = torch.empty_like(counts)
            all_to_all_single(received, counts, [experts] * ranks, [experts] * ranks, self.mesh.group,
                              self.counter, KIND)
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

        x_recv = self._send(x_ND.index_select(0, away), receive, send, compiling)
        y_1 = self._home(x_ND, home_1, expert_1, compiling)
        x_recv = _received(x_recv)
        # the received rows come by sender, then by expert: each row's local expert
        others = received.view(ranks, experts) * (torch.arange(ranks, device=x_ND.device) != me)[:, None]
        local = torch.arange(experts, device=x_ND.device).repeat(ranks)
        expert_R = torch.repeat_interleave(local, others.view(-1), output_size=x_recv.shape[0])
        y_away = self._send(self._run(x_recv, expert_R, compiling), send, receive, compiling)
        y_2 = self._home(x_ND, home_2, expert_2, compiling)
        y_away = _received(y_away)
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

    def _send(self, rows: torch.Tensor, output_splits: list, input_splits: list, compiling: bool):
        """Start sending `rows` to the group's ranks (`input_splits[p]` rows to rank p; `output_splits[p]` come
        from it); `_received` ends it. Eagerly an `_InFlight` pair of autograd functions, counted; in a graph
        the traceable functional collective, whose wait the compiler places and whose bytes no counter sees."""
        if compiling:
            return funcol.all_to_all_single_autograd(rows, output_splits, input_splits, self.mesh.group)
        flight = _InFlight(self, output_splits, input_splits)
        sent = (_Send.apply(rows, flight), flight)
        return sent if self.overlap else _received(sent)

    def exchange(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], async_op=False):
        """`rows` [sum(input_splits), D] to the group's ranks, `input_splits[p]` rows to rank p; returns the
        buffer of the rows received, `output_splits[p]` from rank p (and with `async_op` the work to wait on
        before reading it)."""
        width = rows.shape[1]
        out = rows.new_empty(sum(output_splits), width)
        work = all_to_all_single(out.view(-1), rows.contiguous().view(-1), [n * width for n in output_splits],
                                 [n * width for n in input_splits], self.mesh.group, self.counter, KIND, async_op)
        return (out, work) if async_op else out


def _received(sent) -> torch.Tensor:
    """The rows of an exchange `ParallelExperts._send` started, once they are here."""
    return sent if isinstance(sent, torch.Tensor) else _Receive.apply(*sent)


class _InFlight:
    """One exchange of rows, started by `_Send` and finished by `_Receive` in forward; its gradients' exchange,
    the reverse, is started by `_Receive`'s backward and finished by `_Send`'s. Between the two the autograd
    engine runs what was computed between them in forward (it runs the nodes made later first), so the
    local tokens' backward overlaps the gradients' exchange as their forward overlapped the rows'."""

    def __init__(self, experts: ParallelExperts, output_splits: list, input_splits: list):
        self.experts, self.splits = experts, (output_splits, input_splits)
        self.pending = None

    def start(self, rows: torch.Tensor, output_splits: list, input_splits: list) -> None:
        rows = rows.contiguous()  # kept until the exchange is done
        self.pending = (rows, *self.experts.exchange(rows, output_splits, input_splits, async_op=True))

    def finish(self) -> torch.Tensor:
        _, out, work = self.pending
        work.wait()
        self.pending = None
        return out


class _Send(torch.autograd.Function):
    """Starts the exchange of `rows`; returns an empty tensor that links it to its `_Receive` in the graph."""

    @staticmethod
    def forward(ctx, rows, flight):
        ctx.flight = flight
        flight.start(rows, *flight.splits)
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return ctx.flight.finish(), None


class _Receive(torch.autograd.Function):
    """The received rows; in backward starts sending their gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, link, flight):
        ctx.flight = flight
        return flight.finish()

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.flight.splits
        ctx.flight.start(grad, input_splits, output_splits)
        return grad.new_empty(0), None


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
