"""`train.compile`: blocks compiled with torch.compile train like the eager ones under bf16 autocast, also when
the expert groups change size from batch to batch (the grouped layout is data-dependent)."""

import shutil

import pytest
import torch

import zaya


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_blocks_match_eager_blocks_in_bf16():
    config = zaya.get_preset("micro")
    eager = zaya.build_model(config, seed=3).train()
    compiled = zaya.build_model(config, seed=3).train()
    compiled.blocks[1].compile()  # one block with a previous router state (EDA) keeps the compile time short
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):  # new token ids each step: new expert group sizes
        batch = torch.randint(0, config.vocab_size, (2, 49), generator=generator)
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(batch[:, :-1], batch[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=2e-2, rtol=2e-2)
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            g_eager, g_compiled = p_eager.grad, p_compiled.grad
            assert (g_eager is None) == (g_compiled is None), name
            if g_eager is not None:
                scale = g_eager.abs().max().clamp_min(1e-6)
                assert (g_compiled - g_eager).abs().max() <= 0.05 * scale, name
