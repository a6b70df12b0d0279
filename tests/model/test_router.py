"""The ZAYA1 router: balancing biases select but never gate, the skip route, EDA, fp32 routing."""

import pytest
import torch

from zaya.model.moe import ZayaMoE
from zaya.model.presets import get_preset
from zaya.model.router import ZayaRouter


def _router(use_eda=True, seed=0, **overrides):
    torch.manual_seed(seed)
    router = ZayaRouter(get_preset("micro", **overrides), use_eda=use_eda)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0, 0.3)
    return router


def test_balancing_biases_change_the_choice_but_never_the_gate():
    router = _router()
    x = torch.randn(256, 128)
    base = router(x, None)
    router.balancing_biases[2] = 10.0  # dominates any probability difference
    biased = router(x, None)
    assert torch.all(biased.route == 2) and not torch.all(base.route == 2)
    # the gate is the chosen route's *unbiased* probability, exactly
    torch.testing.assert_close(biased.gate, base.probs[:, 2], rtol=0, atol=0)
    torch.testing.assert_close(biased.probs, base.probs, rtol=0, atol=0)


def test_gate_is_the_unrenormalised_softmax_probability_and_carries_gradient():
    router = _router()
    x = torch.randn(64, 128)
    out = router(x, None)
    torch.testing.assert_close(out.gate, out.probs.gather(1, out.route[:, None]).squeeze(1))
    assert out.probs.sum(-1).allclose(torch.ones(64)) and torch.all(out.gate < 1)
    out.gate.sum().backward()
    assert router.out_proj.weight.grad.abs().sum() > 0
    assert router.balancing_biases.grad is None and not router.balancing_biases.requires_grad


def test_skip_route_is_never_taken_with_its_bias_at_minus_one():
    router = _router(seed=3)
    with torch.no_grad():
        router.out_proj.weight[-1].mul_(20)  # make the skip route's raw probability large
    x = torch.randn(4096, 128)
    out = router(x, None)
    assert out.probs[:, -1].max() > 0.5
    assert not torch.any(out.route == router.num_experts)


@pytest.mark.parametrize("skip_route", ["zero", "identity"])
def test_forced_skip_route_follows_the_configured_semantics(skip_route):
    torch.manual_seed(0)
    moe = ZayaMoE(get_preset("micro", skip_route=skip_route), use_eda=False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    moe.router.balancing_biases.fill_(0.0)
    moe.router.balancing_biases[-1] = 2.0  # beta_skip = +2 forces the skip route
    x = torch.randn(1, 6, 128, requires_grad=True)
    out, routing = moe(x, None)
    assert torch.all(routing.route == 4)
    if skip_route == "zero":
        assert torch.all(out == 0)
    else:
        torch.testing.assert_close(out, routing.gate.view(1, 6, 1) * x)
        out.sum().backward()
        assert moe.router.out_proj.weight.grad.abs().sum() > 0  # the gate learns through g * x


def test_first_moe_layer_has_no_eda_scale_and_ignores_a_state():
    first = _router(use_eda=False)
    assert first.router_states_scale is None
    x = torch.randn(8, 128)
    torch.testing.assert_close(first(x, torch.randn(8, 32)).probs, first(x, None).probs)


def test_eda_state_adds_gamma_times_previous_state_and_passes_gradient_back():
    first, second = _router(use_eda=False, seed=1), _router(use_eda=True, seed=2)
    x0, x1 = torch.randn(16, 128), torch.randn(16, 128)
    r0 = first(x0, None).state
    out = second(x1, r0)
    c1 = second.down_proj(x1)
    torch.testing.assert_close(out.state, c1 + second.router_states_scale * r0)
    out.gate.sum().backward()
    assert first.down_proj.weight.grad is not None and first.down_proj.weight.grad.abs().sum() > 0


def test_routing_runs_in_fp32_under_autocast_and_for_bf16_weights():
    router = _router()
    x = torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x.bfloat16(), None)
    assert out.probs.dtype == torch.float32 and out.gate.dtype == torch.float32
    router.to(torch.bfloat16)
    assert router.balancing_biases.dtype == torch.float32
    assert router(x.bfloat16(), None).probs.dtype == torch.float32
