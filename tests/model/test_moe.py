"""Dropless top-1 dispatch: grouped and padded matmul paths equal a per-expert reference, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import zaya.model.moe as moe
from zaya.model.moe import HAS_GROUPED_MM, Experts, _group_rows
from zaya.model.presets import get_preset


def _experts(seed=0):
    torch.manual_seed(seed)
    experts = Experts(get_preset("micro"))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    return experts


def _reference(experts, x, expert, weight):
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        rows = expert == e
        if rows.any():
            gate, up = (x[rows] @ experts.gate_up_proj[e].t()).chunk(2, -1)
            out[rows] = (F.silu(gate) * up) @ experts.down_proj[e].t() * weight[rows, None]
    return out


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("grouped", [True, False] if HAS_GROUPED_MM else [False])
@pytest.mark.parametrize("pattern", ["random", "one_expert", "some_empty", "few_tokens", "one_token"])
def test_dispatch_matches_per_expert_reference(grouped, pattern, multiple, monkeypatch):
    monkeypatch.setattr(moe, "grouped_mm_row_multiple", lambda device, dtype: multiple)
    experts = _experts()
    experts.use_grouped_mm = grouped
    # fewer tokens than experts take the decoding paths on the CPU (gathered weights; one token: in place)
    N = {"few_tokens": 3, "one_token": 1}.get(pattern, 37)
    expert = {
        "random": torch.randint(0, 4, (N,)),
        "one_expert": torch.full((N,), 2),
        "some_empty": torch.randint(0, 2, (N,)) * 3,
        "few_tokens": torch.tensor([3, 0, 3]),
        "one_token": torch.tensor([2]),
    }[pattern]
    x = torch.randn(N, 128, requires_grad=True)
    weight = torch.rand(N, requires_grad=True)
    out = experts(x, expert, weight)
    ref_experts = _experts()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    ref = _reference(ref_experts, x_ref, expert, w_ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, w_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts.gate_up_proj.grad, ref_experts.gate_up_proj.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts.down_proj.grad, ref_experts.down_proj.grad, atol=1e-5, rtol=1e-5)


def test_broadcast_gradient_is_accepted():
    experts = _experts()
    out = experts(torch.randn(9, 128), torch.randint(0, 4, (9,)), torch.rand(9))
    out.sum().backward()  # an expanded (zero-stride) upstream gradient
    assert torch.isfinite(experts.gate_up_proj.grad).all()


def test_autocast_runs_the_experts_in_bf16_with_fp32_master_gradients():
    experts = _experts()
    x = torch.randn(20, 128)
    expert = torch.randint(0, 4, (20,))
    weight = torch.rand(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, expert, weight)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32
    ref = _reference(_experts(), x, expert, weight)
    assert (out.float() - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("multiple", [1, 4, 32])
def test_grouped_layout_is_contiguous_padded_and_in_token_order(multiple):
    expert = torch.tensor([2, 0, 2, 3, 0, 2, 2, 0, 3])
    row, sizes, rows = _group_rows(expert, 5, multiple)
    counts = torch.bincount(expert, minlength=5)
    assert sizes.tolist() == [-(-int(c) // multiple) * multiple for c in counts]
    assert rows == int(sizes.sum()) and len(set(row.tolist())) == len(expert)
    starts = torch.cumsum(sizes, 0) - sizes
    for e in range(5):
        mine = row[expert == e]
        assert mine.tolist() == list(range(int(starts[e]), int(starts[e]) + int(counts[e])))
