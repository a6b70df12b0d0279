"""Context-parallel CCA: the sequence layouts, and on 2 and 4 gloo ranks the sharded attention layer and the
sharded model against the unsharded ones (fp64: outputs and every gradient to 1e-10), the kernels' work
balance, and what they send against the keys' and values' volume."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zaya
from ranks import run_distributed, summed_over_ranks
from zaya.errors import ZayaError
from zaya.model import segment_attention
from zaya.model.attention import CompressedConvAttention
from zaya.model.layers import RotaryEmbedding
from zaya.parallel.comm import CommCounter
from zaya.parallel.config import ParallelConfig
from zaya.parallel.context import ContextParallel, SequenceLayout

SHARDINGS = ("headtail", "contiguous")
KERNELS = ("allgather", "ring")
EXACT = 1e-10


# ---- layouts (one process) -------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_layout_splits_and_reassembles_every_position_once(ranks, sharding):
    layout = SequenceLayout(48, ranks, sharding)
    assert layout.check(min_chunk=2) is None
    positions = torch.cat([layout.positions(r) for r in range(ranks)])
    assert sorted(positions.tolist()) == list(range(48))
    x = torch.arange(2 * 48).view(2, 48)
    shards = [layout.shard(x, r) for r in range(ranks)]
    assert all(torch.equal(s, x[:, layout.positions(r)]) for r, s in enumerate(shards))
    assert torch.equal(layout.unshard(shards), x)
    for chunk in range(layout.num_chunks):
        rank, slot = layout.owner(chunk)
        assert layout.chunks(rank)[slot] == chunk


def test_head_tail_pairs_an_early_chunk_with_a_late_one():
    layout = SequenceLayout(16, 4, "headtail")
    assert [layout.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize(("length", "ranks", "sharding", "words"), [
    (30, 2, "headtail", "does not split into 2 x cp = 4"),
    (30, 4, "contiguous", "does not split into cp = 4"),
    (8, 4, "headtail", "shorter than the 2 tokens"),
])
def test_a_layout_that_does_not_fit_says_why(length, ranks, sharding, words):
    assert words in SequenceLayout(length, ranks, sharding).check(min_chunk=2)


def test_parallel_config_names_bad_context_parallel_keys():
    with pytest.raises(ZayaError, match=r"parallel\.cp_kernel"):
        ParallelConfig(cp_kernel="tree").validate("run.toml")
    with pytest.raises(ZayaError, match=r"parallel\.cp_sharding"):
        ParallelConfig(cp_sharding="zigzag").validate("run.toml")
    with pytest.raises(ZayaError, match=r"parallel\.cp must divide the world size"):
        ParallelConfig(cp=2).shape(3, "run.toml")


# ---- one block of the kernels (one process) ----------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmuls"])
@pytest.mark.parametrize("causal", [True, False], ids=["diagonal", "full"])
def test_a_block_gives_the_softmax_its_log_sum_exp_and_the_flash_backward(monkeypatch, fused, causal):
    if not fused:  # the plain-matmul path that devices without a fused kernel take
        monkeypatch.setattr(segment_attention, "fused_block_attention", lambda device: None)
    generator = torch.Generator().manual_seed(3)
    B, Hk, g, L, d = 2, 2, 3, 40, 8  # enough queries for the fused kernel
    q5 = torch.randn(B, Hk, g, L, d, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(B, Hk, L, d, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(2))
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q5, k) / d ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1), v)
    grad_out = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    expected.backward(grad_out)
    with torch.no_grad():
        out, lse = segment_attention.block_forward(q5, k, v, causal, d ** -0.5)
        delta = (grad_out * out).sum(-1)
        dq, dk, dv = segment_attention.block_backward(q5, k, v, causal, d ** -0.5, grad_out, lse, delta, out)
    torch.testing.assert_close(out, expected, atol=EXACT, rtol=0)
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=EXACT, rtol=0)
    for ours, theirs in ((dq, q5.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(ours, theirs, atol=EXACT, rtol=0)


# ---- the attention layer (fp64, several processes) --------------------------------------------------------

def _layer(seed: int = 0) -> tuple[CompressedConvAttention, RotaryEmbedding]:
    config = zaya.get_preset("micro")
    torch.manual_seed(seed)
    layer = CompressedConvAttention(config).double()
    with torch.no_grad():
        for param in layer.parameters():  # away from the initial zeros and ones, so every path matters
            param.normal_(0.0, 0.3)
    return layer, RotaryEmbedding(config.head_dim, config.rotary_dim, 10_000.0)


def _gather(tensor: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(layout.ranks)]
    dist.all_gather(parts, tensor.contiguous())
    return layout.unshard(parts)


def _layer_worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    layer, rotary = _layer()
    S, B, D = 40 if world == 2 else 48, 2, layer.q_proj.in_features
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, D, dtype=torch.float64, generator=generator)
    grad_out = torch.randn(B, S, D, dtype=torch.float64, generator=generator)
    q = torch.randn(B, 4, S, 16, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(B, 2, S, 16, dtype=torch.float64, generator=generator) for _ in range(2))

    reference_x = x.clone().requires_grad_()
    layer(reference_x, (*rotary(torch.arange(S)), rotary.partner)).backward(grad_out)
    reference = {name: p.grad.clone() for name, p in layer.named_parameters()}
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True).backward(grad_out[:, None, :, :16].
                                                                                    expand(B, 4, S, 16))
    results = {}
    for sharding in SHARDINGS:
        layout = SequenceLayout(S, world, sharding)
        for kernel in KERNELS:
            layer.zero_grad()
            counter = CommCounter()
            cp = ContextParallel(layout, dist.group.WORLD, kernel, counter)
            errors = {}
            # the layer: output, input gradient and every parameter's gradient (summed over the ranks)
            local_x = cp.shard(x).requires_grad_()
            out = layer(local_x, (*rotary(cp.positions()), rotary.partner), sequence=cp)
            out.backward(cp.shard(grad_out))
            errors["output"] = (_gather(out.detach(), layout) - layer(x, (*rotary(torch.arange(S)),
                                                                          rotary.partner))).abs().max().item()
            errors["grad_x"] = (_gather(local_x.grad, layout) - reference_x.grad).abs().max().item()
            for name, param in layer.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad)
                errors[name] = (grad - reference[name]).abs().max().item()
            work = (cp.attention_work, cp.attention_plan(B, torch.device("cpu")).work)
            # the kernel alone: q, k, v gradients against torch's own causal attention
            local = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
            attention = cp.attention(*local)
            attention.backward(cp.shard(grad_out[:, None, :, :16].expand(B, 4, S, 16), dim=2))
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            gathered = _gather(attention.detach().transpose(1, 2), layout).transpose(1, 2)
            errors["attention"] = (gathered - expected).abs().max().item()
            for name, ours, theirs in zip("qkv", local, qkv, strict=True):
                grad = _gather(ours.grad.transpose(1, 2), layout).transpose(1, 2)
                errors[f"grad_{name}"] = (grad - theirs.grad).abs().max().item()
            results[(sharding, kernel)] = {"errors": errors, "work": work, "sent": counter.take()}
    dist.destroy_process_group()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_attention_equals_the_unsharded_layer(world):
    results = run_distributed(_layer_worker, world, timeout=240)
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            worst = max(result["errors"].values())
            assert worst <= EXACT, (rank, case, result["errors"])
            assert set(result["errors"]) >= {"conv0_weight", "conv1_weight", "v_cur_proj.weight", "v_del_proj.weight",
                                             "q_proj.weight", "k_proj.weight", "grad_q", "grad_k", "grad_v"}
    S, B = (40 if world == 2 else 48), 2
    for kernel in KERNELS:
        # the pairs computed are those of the plan's segments, counted once per forward
        assert all(r[(sharding, kernel)]["work"][0] == r[(sharding, kernel)]["work"][1] for r in results
                   for sharding in SHARDINGS)
        # head-tail: every rank computes the same number of query-key pairs; contiguous: the last rank most
        head_tail = [r[("headtail", kernel)]["work"][0] for r in results]
        contiguous = [r[("contiguous", kernel)]["work"][0] for r in results]
        assert len(set(head_tail)) == 1, head_tail
        assert contiguous == sorted(contiguous) and contiguous[-1] > contiguous[0], contiguous
        # every pair of the causal mask, and no more than the squares of chunks too short for a kernel call of
        # their own (packed whole: `zaya.model.masks`) add
        causal = B * S * (S + 1) // 2
        for work, chunks in ((head_tail, 2 * world), (contiguous, world)):
            L = S // chunks
            assert causal <= sum(work) <= causal + B * chunks * L * (L - 1) // 2, (work, causal)


def test_a_chunk_shorter_than_the_convolutions_reach_is_refused():
    layout = SequenceLayout(8, 4, "headtail")
    assert "shorter than" in layout.check(min_chunk=2)


# ---- the whole model -------------------------------------------------------------------------------------

def _model_worker(rank: int, world: int, preset: str, dtype: str, sharding: str, kernel: str) -> dict:
    """The model's hidden states and the gradients of every parameter, sharded against unsharded. The fp32
    run differentiates the training loss (whose softmax is always fp32); the fp64 one a random projection of
    the hidden states, so that every gradient is an fp64 one."""
    dist.init_process_group("gloo")
    torch.set_default_dtype(getattr(torch, dtype))
    model = zaya.build_model(zaya.get_preset(preset, temp_init=1.0), seed=0)
    S = 64
    L = S // (2 * world if sharding == "headtail" else world)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, S + 1), generator=generator)
    # a document starts at the last input token of a chunk (the token after an eos), its second token on the next
    # chunk: nothing resets at documents (spec 9.1), so this boundary must be as invisible as any other
    ids[:, L - 2] = model.config.eos_token_id or 1
    inputs, targets = ids[:, :-1], ids[:, 1:]
    projection = torch.randn(2, S, model.config.hidden_size, generator=generator)
    cp = ContextParallel(SequenceLayout(S, world, sharding), dist.group.WORLD, kernel)

    def objective(sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not sharded:
            hidden = model.hidden_states(inputs)
            loss = model.loss(inputs, targets) if dtype == "float32" else (hidden * projection).sum()
            return hidden, loss
        local_inputs, local_targets = cp.shard(inputs), cp.shard(targets)
        hidden = model.hidden_states(local_inputs, sequence=cp, positions=cp.positions())
        if dtype == "float32":
            share = local_targets.numel() / targets.numel()
            return hidden, model.loss(local_inputs, local_targets, sequence=cp, positions=cp.positions()) * share
        return hidden, (hidden * cp.shard(projection)).sum()

    full_hidden, full_loss = objective(False)
    full_loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    hidden, loss = objective(True)
    loss.backward()
    total, summed = summed_over_ranks(loss, model)
    relative = {name: ((grad - reference[name]).norm() / reference[name].norm().clamp_min(1e-30)).item()
                for name, grad in summed.items()}
    gathered = _gather(hidden.detach(), cp.layout)
    dist.destroy_process_group()
    assert set(relative) == set(reference)
    return {"loss": (total.item(), full_loss.item()),
            "hidden": ((gathered - full_hidden.detach()).norm() / full_hidden.norm()).item(),
            "grads": relative}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "sharding", "kernel"), [(2, "headtail", "ring"), (4, "contiguous", "allgather")])
def test_the_sharded_micro_model_equals_the_unsharded_one_in_fp64(world, sharding, kernel):
    for result in run_distributed(_model_worker, world, "micro", "float64", sharding, kernel, timeout=240):
        ours, theirs = result["loss"]
        assert abs(ours - theirs) <= EXACT * abs(theirs)
        assert result["hidden"] <= EXACT
        assert max(result["grads"].values()) <= EXACT, result["grads"]


@pytest.mark.slow
def test_the_sharded_small_model_equals_the_unsharded_one_in_fp32():
    for result in run_distributed(_model_worker, 2, "small", "float32", "headtail", "allgather", timeout=300):
        ours, theirs = result["loss"]
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
        assert result["hidden"] <= 1e-5
        assert max(result["grads"].values()) <= 1e-4, result["grads"]
