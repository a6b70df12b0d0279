"""The assembled model: init, residual scaling at init, the fused LM-head loss, bf16 and autocast use."""

import torch
import torch.nn.functional as F

import zaya
from zaya.model.layers import ResidualScaling
from zaya.model.transformer import RouterStats


def test_initialisation_follows_the_spec():
    model = zaya.build_model(zaya.get_preset("micro", temp_init=0.5), seed=0)
    for block in model.blocks:
        assert torch.all(block.attn.temp == 0.5)
        assert torch.all(block.attn_norm.weight == 1) and torch.all(block.moe_norm.weight == 1)
        for res in (block.attn_residual, block.moe_residual):
            assert torch.all(res.branch_scale == 1) and torch.all(res.stream_scale == 1)
            assert torch.all(res.branch_bias == 0) and torch.all(res.stream_bias == 0)
        router = block.moe.router
        assert router.balancing_biases.tolist() == [0.0] * 4 + [-1.0]
        assert (router.router_states_scale is None) == (block.index == 0)
        assert torch.all(router.down_proj.bias == 0)
        assert abs(block.moe.experts.gate_up_proj.std().item() - 0.02) < 0.002
    assert zaya.build_model("micro", seed=0).blocks[0].attn.temp.tolist() == [1.0, 1.0]  # the default temp_init


def test_a_block_at_init_is_a_plain_prenorm_block(make_model):
    model = make_model("micro")
    block = model.blocks[1]
    for res in (block.attn_residual, block.moe_residual):
        res.load_state_dict(ResidualScaling(model.config.hidden_size).state_dict())
    h = torch.randn(2, 6, model.config.hidden_size)
    rope = (*model.rotary(torch.arange(6)), model.rotary.partner)
    state = torch.randn(12, model.config.router_hidden_size)
    with torch.no_grad():
        out, _, _ = block(h, state, rope)
        u = h + block.attn(block.attn_norm(h), rope)
        expected = u + block.moe(block.moe_norm(u), state)[0]
    torch.testing.assert_close(out, expected)


def test_fused_loss_equals_cross_entropy_of_the_logits(make_model):
    model = make_model("micro")
    ids = torch.randint(0, 512, (2, 20))
    targets = torch.randint(0, 512, (2, 20))
    targets[1, :4] = -100
    loss = model.loss(ids, targets, chunk_rows=6)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    reference.backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(fused[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_router_stats_count_every_token_in_every_layer(make_model):
    model = make_model("micro")
    stats = RouterStats(3, 5)
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 9)), router_stats=stats)
    assert stats.tokens == 18 and stats.counts.sum(1).tolist() == [18, 18, 18]
    assert torch.all(stats.entropy_sum > 0)


def test_bf16_model_and_autocast_training_step(make_model):
    model = make_model("micro")
    ids = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    reference = model.to(torch.float32)(ids)
    low = make_model("micro").to(torch.bfloat16)
    assert low.embed.weight.dtype == torch.bfloat16
    assert low.blocks[0].moe.router.balancing_biases.dtype == torch.float32
    with torch.no_grad():
        logits = low(ids)
    assert logits.dtype == torch.float32  # fp32_logits
    assert (logits - reference).abs().max() < 0.5


def test_rope_base_can_be_changed_for_context_extension(make_model):
    model = make_model("micro")
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        before = model(ids)
        model.set_rope_theta(1e6)
        after = model(ids)
    assert model.config.rope_theta == 1e6
    assert (before - after).abs().max() > 1e-4
