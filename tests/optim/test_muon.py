"""Muon: agreement with torch.optim.Muon and with a float64 reference, the Newton-Schulz band, degenerate
gradients, batching, state dicts, DTensor parameters and argument checks."""

from __future__ import annotations

import gc
import io
import math
import shutil

import pytest
import torch

import zaya.optim.ns_iteration as ns_module
from zaya.errors import ZayaError
from zaya.optim.muon import Muon, adjusted_lr, muon_update
from zaya.optim.ns_iteration import NS_COEFFICIENTS, newton_schulz, orthogonalize

# square, tall, wide, stacked tall experts, stacked wide experts
SHAPES = [(48, 48), (64, 32), (32, 64), (4, 48, 24), (3, 24, 48)]
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


@pytest.fixture(autouse=True, params=["plain", "blocks"])
def iteration_form(request, monkeypatch):
    """Every test runs with the plain iteration and with the 2 x 2 block-symmetric one, which the CPU takes
    from 512-wide Gram matrices on; here from 8, so that these small shapes take it too."""
    blocks_from = 8 if request.param == "blocks" else None
    monkeypatch.setattr(ns_module, "newton_schulz_blocks_from", lambda device: blocks_from)
    return request.param


def make_params(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.02 * torch.randn(shape, generator=generator)) for shape in shapes]


def make_grads(shapes, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


def matrices_of(tensor):
    """The [m, n] matrices of a 2-D or stacked 3-D tensor, as 2-D views."""
    return list(tensor.reshape(-1, *tensor.shape[-2:]))


def run(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def reference_muon(params, grads_per_step, *, lr, weight_decay, momentum, nesterov, adjust_lr_fn):
    """torch.optim.Muon's algorithm, matrix by matrix, entirely in float64 (the parameters too)."""
    a, b, c = NS_COEFFICIENTS
    weights = [m.detach().double().clone() for p in params for m in matrices_of(p)]
    buffers = [torch.zeros_like(w) for w in weights]
    for grads in grads_per_step:
        flat = [g.double() for grad in grads for g in matrices_of(grad)]
        for w, g, buf in zip(weights, flat, buffers, strict=True):
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            X = update.T if update.shape[0] > update.shape[1] else update
            X = X / X.norm().clamp(min=1e-7)
            for _ in range(5):
                A = X @ X.T
                X = a * X + (b * A + c * A @ A) @ X
            X = X.T if update.shape[0] > update.shape[1] else X
            w.mul_(1 - lr * weight_decay)
            w.add_(X, alpha=-adjusted_lr(lr, adjust_lr_fn, *w.shape))
    return weights


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_in_bf16(adjust_lr_fn, nesterov):
    hyper = {**HYPER, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    params = make_params(SHAPES)
    start = [p.detach().clone() for p in params]
    # torch.optim.Muon takes 2-D parameters: every expert of a stack is its own parameter there
    torch_params = [torch.nn.Parameter(m.clone()) for p in start for m in matrices_of(p)]
    grads = make_grads(SHAPES, steps=3)
    run(Muon(params, **hyper), params, grads)
    torch_grads = [[m for g in step_grads for m in matrices_of(g)] for step_grads in grads]
    run(torch.optim.Muon(torch_params, **hyper), torch_params, torch_grads)
    theirs = iter(torch_params)
    for param, before in zip(params, start, strict=True):
        for ours, initial in zip(matrices_of(param.detach()), matrices_of(before), strict=True):
            # bf16 rounding alone moves the Newton-Schulz output by 1-4%
            assert relative_error(ours - initial, next(theirs).detach() - initial) <= 5e-2


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_fp32_iteration_matches_float64_reference(adjust_lr_fn):
    hyper = {**HYPER, "adjust_lr_fn": adjust_lr_fn}
    params = make_params(SHAPES)
    expected = reference_muon(params, make_grads(SHAPES, 3), **hyper)
    start = [p.detach().clone() for p in params]
    run(Muon(params, **hyper, ns_dtype=torch.float32), params, make_grads(SHAPES, 3))
    ours = [m for p, s in zip(params, start, strict=True) for m in matrices_of(p.detach().double() - s.double())]
    initial = [m for s in start for m in matrices_of(s.double())]
    for change, w0, w3 in zip(ours, initial, expected, strict=True):
        assert relative_error(change, w3 - w0) <= 1e-5


def test_learning_rate_rules():
    assert adjusted_lr(0.1, "original", 64, 16) == pytest.approx(0.1 * 2.0)
    assert adjusted_lr(0.1, "original", 16, 64) == pytest.approx(0.1)
    assert adjusted_lr(0.1, None, 64, 16) == pytest.approx(0.2)
    assert adjusted_lr(0.1, "match_rms_adamw", 16, 64) == pytest.approx(0.1 * 0.2 * 8.0)


def full_rank_inputs(generator):
    """Random full-rank inputs whose smallest singular value 5 quintic steps can reach: Gaussian rectangles,
    and a square matrix of condition number 100 (a square Gaussian's smallest singular value, ~n^-1.5 of
    its norm, is known to need more steps)."""
    n = 64
    U, _ = torch.linalg.qr(torch.randn(3, n, n, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(3, n, n, generator=generator))
    square = U @ torch.diag_embed(torch.logspace(0, -2, n).expand(3, n)) @ V.mT
    rectangles = [torch.randn(shape, generator=generator) for shape in [(3, 32, 96), (3, 96, 32), (3, 48, 64)]]
    return [square, *rectangles]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_singular_values_land_in_the_quintic_band(dtype):
    for G in full_rank_inputs(torch.Generator().manual_seed(0)):
        out = newton_schulz(G, dtype=dtype)
        assert out.shape == G.shape and out.dtype == dtype
        singular = torch.linalg.svdvals(out.float())
        assert singular.min() >= 0.5 and singular.max() <= 1.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rank_deficient_and_zero_inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    low_rank = torch.randn(2, 40, 3, generator=generator) @ torch.randn(2, 3, 24, generator=generator)
    out = newton_schulz(low_rank, dtype=dtype).float()
    assert torch.isfinite(out).all()
    singular = torch.linalg.svdvals(out)
    assert (singular[:, :3] >= 0.5).all() and (singular[:, :3] <= 1.5).all()
    if dtype == torch.float32:
        # the null space stays empty; in bf16 its rounding noise is amplified like any small singular value
        assert (singular[:, 3:] <= 1e-3).all()
    zero = newton_schulz(torch.zeros(2, 16, 8), dtype=dtype)
    assert torch.equal(zero, torch.zeros_like(zero))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3), (0, 4, 4)])
def test_empty_matrices_pass_through(shape):
    assert newton_schulz(torch.zeros(shape)).shape == torch.Size(shape)
    empty, full = torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.ones(6, 4))
    empty.grad, full.grad = torch.zeros(shape), torch.randn(6, 4)
    optimizer = Muon([empty, full], lr=0.1, adjust_lr_fn="original")
    optimizer.step()
    assert empty.shape == torch.Size(shape) and optimizer.state[empty]["momentum_buffer"].shape == torch.Size(shape)
    assert not torch.equal(full, torch.ones(6, 4))


def test_zero_gradient_gives_zero_update():
    params = make_params(SHAPES)
    start = [p.detach().clone() for p in params]
    run(Muon(params, lr=0.1, weight_decay=0.0), params, [[torch.zeros(s) for s in SHAPES]] * 2)
    for param, before in zip(params, start, strict=True):
        assert torch.equal(param.detach(), before)


def test_block_iteration_needs_an_even_gram_side(monkeypatch):
    G = torch.randn(3, 25, 40, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(ns_module, "newton_schulz_blocks_from", lambda device: None)
    plain = newton_schulz(G, dtype=torch.float32)
    monkeypatch.setattr(ns_module, "newton_schulz_blocks_from", lambda device: 8)
    assert torch.equal(newton_schulz(G, dtype=torch.float32), plain)  # 25 is odd: the plain iteration
    blocks = newton_schulz(G[:, :24], dtype=torch.float32)
    monkeypatch.setattr(ns_module, "newton_schulz_blocks_from", lambda device: None)
    plain = newton_schulz(G[:, :24], dtype=torch.float32)
    assert not torch.equal(blocks, plain)  # 24 is even: the block iteration, equal up to rounding
    torch.testing.assert_close(blocks, plain, atol=1e-5, rtol=1e-5)


def test_batched_equals_one_by_one():
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in [(5, 24, 40), (24, 40), (40, 24), (2, 40, 24)]]
    together = orthogonalize(tensors, dtype=torch.float32)
    for tensor, out in zip(tensors, together, strict=True):
        assert out.shape == tensor.shape
        one_by_one = torch.stack([newton_schulz(m, dtype=torch.float32) for m in matrices_of(tensor)])
        torch.testing.assert_close(out.reshape(one_by_one.shape), one_by_one, atol=1e-5, rtol=1e-5)


def test_muon_update_on_full_local_matrices():
    grads = [g for g in make_grads([(4, 32, 16), (16, 24)], steps=1)[0]]
    buffers = [torch.randn(g.shape, generator=torch.Generator().manual_seed(5)) for g in grads]
    expected_buffers = [b.lerp(g, 1 - 0.9) for g, b in zip(grads, buffers, strict=True)]
    updates = muon_update(grads, buffers, momentum=0.9, nesterov=True, dtype=torch.float32)
    for grad, buffer, expected, update in zip(grads, buffers, expected_buffers, updates, strict=True):
        torch.testing.assert_close(buffer, expected, atol=0, rtol=0)
        direction = grad.lerp(expected, 0.9).reshape(-1, *grad.shape[-2:])
        reference = newton_schulz(direction, dtype=torch.float32).reshape(grad.shape)
        torch.testing.assert_close(update, reference, atol=1e-6, rtol=1e-6)


def test_stacked_experts_equal_separate_matrices():
    stacked = make_params([(4, 32, 16)])
    separate = [torch.nn.Parameter(m.clone()) for m in matrices_of(stacked[0].detach())]
    grads = make_grads([(4, 32, 16)], steps=2)
    run(Muon(stacked, **HYPER, ns_dtype=torch.float32), stacked, grads)
    run(Muon(separate, **HYPER, ns_dtype=torch.float32), separate, [matrices_of(g[0]) for g in grads])
    torch.testing.assert_close(stacked[0].detach(), torch.stack([p.detach() for p in separate]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_and_slices_change_nothing(monkeypatch, dtype):
    """The CPU path cuts batches into cache-sized chunks and the elementwise work into slices: with one
    matrix per chunk and per slice, a step gives what whole batches give."""
    results = []
    for cut in (False, True):
        if cut:
            monkeypatch.setattr(ns_module, "CPU_CHUNK_BYTES", 1)
            monkeypatch.setattr(ns_module, "CPU_SLICE_BYTES", 1)
        params = make_params(SHAPES)
        run(Muon(params, **HYPER, ns_dtype=dtype), params, make_grads(SHAPES, steps=2))
        results.append([p.detach() for p in params])
    for whole, cut in zip(*results, strict=True):
        torch.testing.assert_close(cut, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("total", [1, 7, 32, 33, 257])
@pytest.mark.parametrize("per", [1, 3, 21, 64])
def test_chunk_sizes_are_balanced(monkeypatch, total, per, threads):
    """Chunks of a batch are no more than the cache budget needs, of nearly equal size, and a multiple of the
    thread count where the size exceeds it (an odd batch leaves one of two threads idle at its end)."""
    monkeypatch.setattr(ns_module, "batched_matmul_multiple", lambda device: threads)
    size = ns_module._balanced(total, per, torch.device("cpu"))
    chunks = -(-total // size)
    assert chunks <= -(-total // per)
    assert size <= total and size < per + threads
    if size > threads and size < total:
        assert size % threads == 0
    if chunks > 1:  # as equal as whole chunks of a multiple of the thread count allow
        assert size < -(-total // chunks) + threads


def plain(node):
    """True if a state dict holds only tensors, numbers, strings, booleans, None and containers of them."""
    if isinstance(node, dict):
        return all(isinstance(k, (str, int)) and plain(v) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return all(plain(v) for v in node)
    return node is None or isinstance(node, (torch.Tensor, bool, int, float, str))


def test_state_dict_round_trip_is_exact():
    params = make_params(SHAPES)
    optimizer = Muon(params, **HYPER, adjust_lr_fn="match_rms_adamw")
    grads = make_grads(SHAPES, steps=3)
    run(optimizer, params, grads[:2])
    state = optimizer.state_dict()
    assert plain(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Muon(resumed_params, lr=1.0)  # hyperparameters come from the state dict
    resumed.load_state_dict(loaded)
    assert resumed.param_groups[0]["lr"] == HYPER["lr"]
    run(optimizer, params, grads[2:])
    run(resumed, resumed_params, grads[2:])
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_iteration_matches_eager():
    G = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(0))
    eager = newton_schulz(G, dtype=torch.float32, backend="eager")
    compiled = newton_schulz(G, dtype=torch.float32, backend="compiled")
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_dtensor_parameters_match_plain_ones(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    shapes = [(48, 32), (4, 24, 40)]  # a gathered matrix, and a stack whose shards hold whole matrices
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain_params = make_params(shapes)
        sharded = [
            torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain_params
        ]
        grads = make_grads(shapes, steps=2)
        run(Muon(plain_params, **HYPER), plain_params, grads)
        optimizer = Muon(sharded, **HYPER)
        for step_grads in grads:
            for param, grad in zip(sharded, step_grads, strict=True):
                param.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            optimizer.step()
        for a, b in zip(plain_params, sharded, strict=True):
            assert torch.equal(b.detach().full_tensor(), a.detach())
    finally:
        dist.destroy_process_group()


# uneven row shards; even ones; an expert stack split unevenly; a one-expert stack, empty on the second rank
FSDP_SHAPES = [(5, 12), (24, 16), (3, 8, 12), (1, 4, 4)]


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrices = torch.nn.ParameterList(make_params(FSDP_SHAPES))


def _fsdp_worker(rank: int, world: int, init_method: str, iteration_form: str) -> None:
    """Muon on FSDP2-sharded parameters (DTensors, Shard(0)) must equal Muon on the plain parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if iteration_form == "blocks":
        ns_module.newton_schulz_blocks_from = lambda device: 8
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sharded, plain = _Holder(), _Holder()
        fully_shard(sharded, mesh=mesh)
        grads = make_grads(FSDP_SHAPES, steps=3)
        run(Muon(plain.parameters(), **HYPER), list(plain.parameters()), grads)
        optimizer = Muon(sharded.parameters(), **HYPER)
        for step_grads in grads:
            for param, grad in zip(sharded.parameters(), step_grads, strict=True):
                param.grad = distribute_tensor(grad.clone(), mesh, param.placements)
            optimizer.step()
        for a, b in zip(plain.parameters(), sharded.parameters(), strict=True):
            assert torch.equal(b.detach().full_tensor(), a.detach()), f"shape {list(a.shape)} differs on rank {rank}"
    finally:
        # DTensor collectives leave reference cycles holding gloo work; collected during interpreter
        # finalisation they abort the process now and then ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


def test_fsdp2_sharded_parameters_match_plain_ones_on_two_ranks(tmp_path, iteration_form):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, f"file://{tmp_path}/store", iteration_form), nprocs=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": math.nan}, "weight_decay"),
        ({"momentum": 1.0}, "momentum"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"),
        ({"eps": 0.0}, "eps"),
        ({"adjust_lr_fn": "rms"}, "adjust_lr_fn"),
        ({"ns_dtype": torch.float16}, "ns_dtype"),
        ({"ns_backend": "triton"}, "ns_backend"),
    ],
)
def test_bad_hyperparameters_name_the_field(kwargs, field):
    with pytest.raises(ZayaError, match=f"'{field}'"):
        Muon(make_params([(8, 8)]), **kwargs)


def test_tensor_learning_rate_equals_a_float_one():
    """torch's optimizers take `lr` as a one-element tensor too; its current value is used at every step."""
    shapes = [(16, 24), (3, 16, 8)]
    grads = make_grads(shapes, 3)
    floats, tensors = make_params(shapes), make_params(shapes)
    hyper = {**HYPER, "adjust_lr_fn": "match_rms_adamw"}
    run(Muon(floats, **hyper), floats, grads)
    lr = torch.tensor(hyper.pop("lr"), dtype=torch.float64)  # holds 0.02 exactly, as the float does
    optimizer = Muon(tensors, lr=lr, **hyper)
    run(optimizer, tensors, grads)
    for a, b in zip(floats, tensors, strict=True):
        assert torch.equal(a, b)
    lr.fill_(0.0)  # read at the step: with lr 0 nothing moves (decoupled weight decay scales with lr)
    before = [p.detach().clone() for p in tensors]
    run(optimizer, tensors, grads[:1])
    for a, b in zip(before, tensors, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lr", [torch.tensor([0.1, 0.2]), torch.tensor(1), torch.tensor(-0.1)])
def test_bad_tensor_learning_rates_are_refused(lr):
    with pytest.raises(ZayaError, match="'lr'"):
        Muon(make_params([(8, 8)]), lr=lr)


def test_vectors_are_refused():
    with pytest.raises(ZayaError, match=r"shape \[8\]"):
        Muon([torch.nn.Parameter(torch.zeros(8))])
