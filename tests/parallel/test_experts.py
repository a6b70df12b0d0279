"""Expert parallelism's token exchange (`zaya.parallel.experts.ParallelExperts`) on gloo ranks against every
expert in one process: outputs, input gradients and each rank's expert gradients; the bytes sent against the
routes (skipped tokens never travel; a rank may send nothing or receive nothing); one host read per layer; the
tokens that stay computed while the others travel, in forward and in backward."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zaya
from host_syncs import HostSyncs
from ranks import run_distributed
from zaya.model.moe import Experts
from zaya.parallel.comm import CommCounter
from zaya.parallel.config import ParallelConfig
from zaya.parallel.experts import KIND, ParallelExperts
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import init_parallel

E, D, TOKENS = 4, 128, 37  # the micro preset's experts and width; a token count no split divides


def _routes(case: str, rank: int, generator: torch.Generator) -> torch.Tensor:
    if case == "spread":  # every expert and the skip route (E)
        return torch.randint(0, E + 1, (TOKENS,), generator=generator)
    if case == "one-rank":  # every token of every rank to rank 0's experts: rank 1 receives nothing
        return torch.randint(0, E // 2, (TOKENS,), generator=generator)
    # "stay-home": each rank routes to its own experts only, and rank 1 skips every token: nothing travels
    if rank == 1:
        return torch.full((TOKENS,), E)
    return torch.randint(0, E // 2, (TOKENS,), generator=generator)


def _exchange_worker(rank: int, world: int, case: str, monkeypatch_tolist: bool) -> dict:
    context = init_parallel(ParallelConfig(ep=world), torch.device("cpu"), Launch.from_env(os.environ))
    torch.manual_seed(0)  # the same whole experts on every rank
    whole = Experts(zaya.get_preset("micro"))
    torch.nn.init.normal_(whole.gate_up_proj, std=0.05)
    torch.nn.init.normal_(whole.down_proj, std=0.05)
    counter = CommCounter()
    ours = ParallelExperts(whole, context.experts, counter)  # a copy of its experts of the whole stacks
    generator = torch.Generator().manual_seed(100 + rank)
    route = _routes(case, rank, generator)
    x = torch.randn(TOKENS, D, generator=generator)
    weight = torch.rand(TOKENS, generator=generator).masked_fill(route == E, 0.0)
    probe = torch.randn(TOKENS, D, generator=generator)

    reads = []
    tolist = torch.Tensor.tolist
    if monkeypatch_tolist:
        torch.Tensor.tolist = lambda self: reads.append(self.numel()) or tolist(self)
    x_ours, w_ours = x.clone().requires_grad_(), weight.clone().requires_grad_()
    with HostSyncs() as syncs:
        y = ours(x_ours, route, w_ours)
        (y * probe).sum().backward()
    torch.Tensor.tolist = tolist
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_ref = whole(x_ref, route, w_ref)
    (y_ref * probe).sum().backward()
    # each rank's experts took gradients from the tokens of every rank routed to them
    for param in (whole.gate_up_proj, whole.down_proj):
        torch.distributed.all_reduce(param.grad)
    rows = slice(ours.first, ours.first + ours.num_experts)
    counts = torch.bincount(route, minlength=E + 1)[:E].view(world, -1).sum(1)  # rows to each rank
    received = torch.empty_like(counts)
    torch.distributed.all_to_all_single(received, counts)
    context.close()
    routed = route < E  # a skipped token's weight is the masked gate: no gradient goes through it in the model
    return {
        "y": (y.detach(), y_ref.detach()), "x_grad": (x_ours.grad, x_ref.grad),
        "w_grad": (w_ours.grad[routed], w_ref.grad[routed]),
        "gate_up_grad": (ours.gate_up_proj.grad, whole.gate_up_proj.grad[rows]),
        "down_grad": (ours.down_proj.grad, whole.down_proj.grad[rows]),
        "sent": counter.take().get(KIND, 0), "rows_out": int(counts.sum() - counts[rank]),
        "rows_in": int(received.sum() - received[rank]), "syncs": syncs.ops, "reads": reads,
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["spread", "one-rank", "stay-home"])
def test_the_token_exchange_equals_every_expert_in_one_process(case):
    world = 2
    results = run_distributed(_exchange_worker, world, case, True, timeout=120)
    for rank, result in enumerate(results):
        for key in ("y", "x_grad", "w_grad", "gate_up_grad", "down_grad"):
            ours, theirs = result[key]
            assert ours is not None, (rank, key)  # a rank that receives nothing still has (zero) gradients
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
        # per direction, forward and backward: the rows routed to the other rank out, those it routed here
        # back; D fp32 values a row; plus the counts (E/ep int64 to each other rank)
        rows = result["rows_out"] + result["rows_in"]
        assert result["sent"] == 2 * rows * D * 4 + (world - 1) * (E // world) * 8, rank
        assert result["syncs"] == []  # nothing else waits on the device
        assert result["reads"] == [world + E]  # the one host read: the sizes to send and to receive
    if case == "one-rank":
        assert results[1]["gate_up_grad"][0].abs().sum() == 0  # it received no token
    if case == "stay-home":
        assert all(r["sent"] == (world - 1) * (E // world) * 8 for r in results)  # no token travelled


START, WAIT = "_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor"


class _Order(TorchDispatchMode):
    """The ops dispatched inside, in order."""

    def __init__(self):
        super().__init__()
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _windows(ops: list[str]) -> list[bool]:
    """For each exchange started in `ops` (in order), whether a matmul ran while it was in flight."""
    out, current = [], None
    for name in ops:
        if name.startswith(START):
            current = False
        elif name.startswith(WAIT):
            out.append(current)
        elif current is not None and "mm" in name:
            current = True
    return out


def _graph_ops(experts: ParallelExperts, x: torch.Tensor, route: torch.Tensor) -> list[list[str]]:
    """The ops of the forward and backward graphs `torch.compile` makes of `experts` (as inductor gets them)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(graph, _):
        graphs.append([str(node.target).replace(".", "::", 1) for node in graph.graph.nodes
                       if node.op == "call_function"])
        return make_boxed_func(graph.forward)

    capture = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = True  # as `parallelize` sets it
    try:
        compiled = torch.compile(experts, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                                 fullgraph=True)
        compiled(x.clone().requires_grad_(), route, None).square().sum().backward()
    finally:
        torch._dynamo.config.capture_scalar_outputs = capture
        torch._dynamo.reset()
    return graphs


def _overlap_worker(rank: int, world: int) -> dict:
    context = init_parallel(ParallelConfig(ep=world), torch.device("cpu"), Launch.from_env(os.environ))
    torch.manual_seed(0)
    whole = Experts(zaya.get_preset("micro"))
    torch.nn.init.normal_(whole.gate_up_proj, std=0.05)
    torch.nn.init.normal_(whole.down_proj, std=0.05)
    generator = torch.Generator().manual_seed(7 + rank)
    route = torch.randint(0, E, (4 * TOKENS,), generator=generator)  # every rank keeps and sends some
    x = torch.randn(4 * TOKENS, D, generator=generator)
    windows, outputs = {}, {}
    for overlap in (True, False):
        order = _Order()
        experts = ParallelExperts(whole, context.experts, overlap=overlap)
        x_in = x.clone().requires_grad_()
        with order:
            y = experts(x_in, route, None)
            y.square().sum().backward()
        windows[overlap] = _windows(order.log)
        outputs[overlap] = (y.detach(), x_in.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    graphs = [_windows(ops) for ops in _graph_ops(ParallelExperts(whole, context.experts), x, route)]
    context.close()
    return {"windows": windows, "outputs": outputs, "graphs": graphs}


@pytest.mark.slow
def test_the_tokens_that_stay_are_computed_while_the_others_travel():
    """Forward: half the rows for this rank's own experts run while the others go out, half while the outputs
    come back; backward: the same halves' gradients while the gradients travel the other way. Without overlap
    the same work gives the same values, and nothing runs while an exchange is in flight. The compiled graphs
    keep the order (their first exchange is the counts', waited for at once)."""
    for result in run_distributed(_overlap_worker, 2, timeout=120):
        assert result["windows"][True] == [True] * 4  # two exchanges forward, two backward
        assert result["windows"][False] == [False] * 4
        for ours, theirs in zip(*result["outputs"].values(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert result["graphs"] == [[False, True, True], [True, True]]
