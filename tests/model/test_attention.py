"""CCGQA: prefill equals token-by-token decoding, causality, and the first positions of the two convolutions."""

import math

import pytest
import torch
import torch.nn.functional as F

import zaya
from zaya.model.attention import CompressedConvAttention
from zaya.model.layers import RotaryEmbedding


@pytest.mark.parametrize("length", [1, 2, 3, 50])
def test_prefill_equals_incremental_decoding(make_model, length):
    model = make_model("micro")
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        stepwise = torch.cat([model(ids[:, t : t + 1], cache) for t in range(length)], dim=1)
    assert cache.length == length
    torch.testing.assert_close(stepwise, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 3, 17])
def test_chunked_prefill_continues_the_cache(make_model, split):
    model = make_model("micro", cca_time0=3, cca_time1=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(split))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :split], cache), model(ids[:, split:split + 5], cache), model(ids[:, split + 5 :], cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_changing_a_token_never_changes_earlier_outputs(make_model):
    model = make_model("micro")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=generator)
    with torch.no_grad():
        base = model(ids)
        for t in (0, 1, 2, 11, 23):
            changed = ids.clone()
            changed[0, t] = (changed[0, t] + 1 + t) % model.config.vocab_size
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-4, "the changed position itself must change"


def _reference_qkv(attn: CompressedConvAttention, x: torch.Tensor):
    """An independent rendering of spec section 4.2 with nn.functional convolutions (pad once by P)."""
    B, T, _ = x.shape
    Hq, Hk, d = attn.num_q_heads, attn.num_kv_heads, attn.head_dim
    q_lat, k_lat = attn.q_proj(x), attn.k_proj(x)
    groups = Hq // Hk
    mu_q = torch.stack([(q_lat.view(B, T, Hq, d)[:, :, h] + k_lat.view(B, T, Hk, d)[:, :, h // groups]) / 2
                        for h in range(Hq)], dim=2)
    mu_k = torch.stack([mu_q[:, :, j * groups:(j + 1) * groups].mean(2) for j in range(Hk)], dim=2)
    p = torch.cat([q_lat, k_lat], -1).transpose(1, 2)
    p = F.pad(p, (attn.padding, 0))
    y = F.conv1d(p, attn.conv0_weight, attn.conv0_bias, groups=p.shape[1])
    z = F.conv1d(y, attn.conv1_weight, attn.conv1_bias, groups=Hq + Hk).transpose(1, 2)
    q = z[..., : Hq * d].reshape(B, T, Hq, d) + mu_q
    k = z[..., Hq * d :].reshape(B, T, Hk, d) + mu_k
    x_prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
    v = torch.cat([attn.v_cur_proj(x), attn.v_del_proj(x_prev)], -1).view(B, T, Hk, d)
    return q, k, v, y


def _reference_rope(x: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """NeoX rotate-half on the first rotary_dim dims of x [B, T, H, d], positions 0..T-1."""
    T, half = x.shape[1], rotary_dim // 2
    angles = torch.arange(T, dtype=torch.float32)[:, None] * base ** (-torch.arange(half) * 2 / rotary_dim)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


@pytest.mark.parametrize("kernels", [(2, 2), (3, 2), (2, 4)])
def test_two_stage_convolution_matches_a_single_padding_reference(make_model, kernels):
    model = make_model("micro", cca_time0=kernels[0], cca_time1=kernels[1])
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, model.config.hidden_size)
    q_ref, k_ref, v_ref, y_ref = _reference_qkv(attn, x)
    # y_{-1} (the first intermediate output) must be b0 for the default kernels, not 0
    if kernels == (2, 2):
        torch.testing.assert_close(y_ref[:, :, 0], attn.conv0_bias.expand(2, -1))
    captured = {}

    def capture(_module, _inputs, output):
        captured["o_in"] = _inputs[0]

    handle = attn.o_proj.register_forward_hook(capture)
    rotary = RotaryEmbedding(model.config.head_dim, model.config.rotary_dim, model.config.rope_theta)
    with torch.no_grad():
        attn(x, (*rotary(torch.arange(9)), rotary.partner))
        handle.remove()
        d = attn.head_dim
        qn = q_ref * (math.sqrt(d) / q_ref.norm(dim=-1, keepdim=True))
        kn = k_ref * (math.sqrt(d) / k_ref.norm(dim=-1, keepdim=True)) * attn.temp[None, None, :, None]
        qn = _reference_rope(qn, model.config.rotary_dim, model.config.rope_theta).transpose(1, 2)
        kn = _reference_rope(kn, model.config.rotary_dim, model.config.rope_theta).transpose(1, 2)
        kn = kn.repeat_interleave(attn.group_size, 1)
        vv = v_ref.transpose(1, 2).repeat_interleave(attn.group_size, 1)
        scores = (qn @ kn.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(9, 9, dtype=torch.bool), 1), float("-inf"))
        expected = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(2, 9, -1)
    torch.testing.assert_close(captured["o_in"], expected, atol=1e-5, rtol=1e-5)


def test_first_delayed_value_is_zero_and_value_heads_split_current_and_previous(make_model):
    model = make_model("micro")
    attn = model.blocks[0].attn
    x = torch.randn(1, 5, model.config.hidden_size)
    _, _, v, _ = _reference_qkv(attn, x)
    half = model.config.num_key_value_heads // 2
    assert torch.all(v[:, 0, half:] == 0)
    torch.testing.assert_close(v[:, 1:, half:].flatten(2), attn.v_del_proj(x[:, :-1]))


def test_kv_cache_holds_two_kv_heads_per_token_per_layer(make_model):
    model = make_model("micro")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 7)), cache)
    layer = cache.layers[0]
    per_token = layer.keys[:, :, : layer.length].numel() // 7 + layer.values[:, :, : layer.length].numel() // 7
    assert per_token == model.config.kv_cache_values_per_token == 2 * 2 * 16
    assert layer.conv_state.shape == (1, model.config.conv_padding, model.config.conv_channels)
    assert layer.value_state.shape == (1, 1, model.config.key_latent // 2)


def test_derived_weights_are_remembered_only_while_decoding(make_model):
    attention = make_model("micro").blocks[0].attn
    with torch.no_grad():  # an evaluation in training
        before = attention.input_weight().clone()
        # new values in the same storage with the same version count, as FSDP2 refills a gathered parameter
        attention.q_proj.weight.data.mul_(2.0)
        assert not torch.equal(attention.input_weight(), before)
    with torch.inference_mode():  # decoding: built once, reused while the weights stay
        first = attention.input_weight()
        assert attention.input_weight() is first
        attention.q_proj.weight.mul_(0.5)
        assert not torch.equal(attention.input_weight(), first)


def test_the_rope_frequencies_stay_exact_fp32_through_casts_and_a_new_base(tmp_path):
    model = zaya.build_model("micro", seed=0)
    exact = RotaryEmbedding._inv_freq(model.rotary.rotary_dim, model.config.rope_theta)
    model.to(torch.bfloat16)  # would round them to 8 bits of mantissa
    assert model.rotary.inv_freq.dtype == torch.float32 and torch.equal(model.rotary.inv_freq, exact)
    model.rotary.set_base(5e5)  # a long-context phase's base survives the next cast
    model.to(torch.float32)
    assert torch.equal(model.rotary.inv_freq, RotaryEmbedding._inv_freq(model.rotary.rotary_dim, 5e5))
    zaya.export_hf(model.to(torch.bfloat16), tmp_path / "export")  # loaded back in bf16, then asked in fp32
    loaded = zaya.load_model(tmp_path / "export", dtype=torch.float32)
    assert torch.equal(loaded.rotary.inv_freq, exact)
