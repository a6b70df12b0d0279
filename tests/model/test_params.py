import pytest

from zaya.model.config import ZayaConfig
from zaya.model.params import parameter_report
from zaya.model.presets import get_preset, preset_names


def test_zaya1_base_counts_match_the_published_shapes():
    report = parameter_report(get_preset("zaya1-base"))
    assert report.non_embedding == 8_303_355_728
    assert report.active_non_embedding == 753_608_528
    assert report.embedding == 537_133_056
    assert report.total == 8_840_488_784


@pytest.mark.parametrize(
    ("preset", "total", "active"), [("micro", 402_598, 181_414), ("mini", 3_704_008, 951_496)]
)
def test_small_faithful_configs_match_the_spec_table(preset, total, active):
    report = parameter_report(get_preset(preset))
    assert (report.non_embedding, report.active_non_embedding) == (total, active)


def test_components_add_up_and_experts_dominate():
    for name in preset_names():
        report = parameter_report(get_preset(name))
        assert sum(report.per_component.values()) == report.total
        assert sum(report.per_component_active.values()) == report.active
        assert report.per_component["experts"] > report.per_component["attention"]


def test_attention_and_router_counts_at_full_size():
    # spec section 2: attention 5,575,682 and router 660,736 (+256 EDA gamma) per layer
    report = parameter_report(get_preset("zaya1-base"))
    assert report.per_component["attention"] == 40 * 5_575_682
    assert report.per_component["router"] == 40 * 660_736 + 39 * 256


def test_closed_form_count_for_an_arbitrary_shape():
    c = ZayaConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=8, num_experts=3, moe_intermediate_size=24, router_hidden_size=16, cca_time0=3)
    D, Q, K, C, R, E, F = 48, 48, 16, 64, 16, 3, 24
    attention = D * Q + D * K + 2 * D * (K // 2) + Q * D + C * 3 + C + C * 8 * 2 + C + 2
    router = D * R + R + R + 2 * (R * R + R) + R * (E + 1)
    experts = E * 3 * D * F
    per_block = attention + router + experts + 2 * D + 8 * D
    expected = 3 * per_block + 2 * R + 2 * D + D + 300 * D
    assert parameter_report(c).total == expected
