"""The balancing-bias controller: it evens out a skewed router, never touches the gate, and its integral-only
sign form is DeepSeek-V3's loss-free balancing."""

import pytest
import torch

from zaya.model.presets import get_preset
from zaya.model.router import ZayaRouter
from zaya.train.balance import BalanceController, load_imbalance


def _skewed_router(seed: int = 0) -> ZayaRouter:
    torch.manual_seed(seed)
    router = ZayaRouter(get_preset("micro"), use_eda=False)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0, 0.2)
        router.out_proj.weight[0] += 0.5  # expert 0 is favoured for most inputs
    return router


def _counts(router: ZayaRouter, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        route = router(x, None).route
    return torch.bincount(route, minlength=router.num_experts + 1)[None]


@pytest.mark.parametrize(("kp", "ki", "error"), [(0.0, 0.02, "linear"), (0.02, 0.01, "linear"), (0.0, 0.01, "sign")])
def test_controller_shrinks_the_load_imbalance(kp, ki, error):
    router = _skewed_router()
    controller = BalanceController([router], kp=kp, ki=ki, kd=0.0, error=error)
    generator = torch.Generator().manual_seed(1)
    imbalance = []
    for _ in range(60):
        counts = _counts(router, torch.randn(512, 128, generator=generator))
        imbalance.append(float(load_imbalance(counts)[0]))
        controller.update(counts)
    assert imbalance[0] > 2.5, "the synthetic router must start skewed"
    assert sum(imbalance[-10:]) / 10 < 0.6 * imbalance[0]
    assert router.balancing_biases[-1] == -1.0  # the skip route's bias stays put
    assert abs(float(router.balancing_biases[:-1].mean())) < 1e-6  # re-centred


def test_integral_sign_form_is_loss_free_balancing():
    router = _skewed_router(3)
    controller = BalanceController([router], kp=0.0, ki=1e-3, kd=0.0, error="sign")
    counts = torch.tensor([[100, 10, 30, 60, 0]])
    before = router.balancing_biases.clone()
    controller.update(counts)
    load = counts[0, :4].double() / 200
    expected = before[:4] + 1e-3 * torch.sign(0.25 - load).float()
    expected -= expected.mean()
    torch.testing.assert_close(router.balancing_biases[:4], expected)


def test_controller_state_round_trips():
    router = _skewed_router()
    controller = BalanceController([router], kp=0.1, ki=0.01, kd=0.05)
    for _ in range(3):
        controller.update(_counts(router, torch.randn(64, 128)))
    state = {k: v.clone() for k, v in controller.state.state_dict().items()}
    other = BalanceController([_skewed_router()], kp=0.1, ki=0.01, kd=0.05)
    other.state.load_state_dict(state)
    for key, value in other.state.state_dict().items():
        assert torch.equal(value, state[key]), key
