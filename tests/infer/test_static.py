"""The fixed-capacity decode step: eager it equals the growing-cache path; compiled it gives the same tokens."""

import pytest
import torch

from zaya.errors import ZayaError
from zaya.infer.generate import Sampling, generate
from zaya.infer.static import CompiledDecoder, StaticCache, decode_step, round_capacity


def _decode_both_ways(model, prompt, steps, capacity):
    """Logits of `steps` single-token steps after `prompt`, through the eager cache and the static one."""
    with torch.inference_mode():
        cache = model.new_cache()
        model.hidden_states(prompt, cache)
        static = StaticCache.from_cache(cache, capacity)
        tokens = torch.randint(0, model.config.vocab_size, (steps, prompt.shape[0]),
                               generator=torch.Generator().manual_seed(1))
        eager, fixed = [], []
        for i, token in enumerate(tokens):
            eager.append(model(token[:, None], cache)[:, -1])
            fixed.append(decode_step(model, token, torch.tensor(prompt.shape[1] + i), static))
    return torch.stack(eager), torch.stack(fixed)


@pytest.mark.parametrize(
    "preset, overrides, batch, prompt_len",
    [
        ("micro", {}, 1, 1),
        ("micro", {}, 3, 7),
        ("micro", {"skip_route": "identity"}, 2, 4),
        ("mini", {"num_key_value_heads": 4, "num_attention_heads": 8}, 2, 5),
    ],
)
def test_static_step_equals_the_growing_cache(make_model, preset, overrides, batch, prompt_len):
    model = make_model(preset, **overrides)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    eager, fixed = _decode_both_ways(model, prompt, steps=6, capacity=prompt_len + 9)
    torch.testing.assert_close(fixed, eager, atol=1e-5, rtol=1e-5)


def test_forced_skip_route_in_the_static_step(make_model):
    model = make_model("micro", skip_route="identity")
    for block in model.blocks:
        block.moe.router.balancing_biases[-1] = 10.0  # every token takes the skip route
    prompt = torch.tensor([[3, 1, 4]])
    eager, fixed = _decode_both_ways(model, prompt, steps=3, capacity=8)
    torch.testing.assert_close(fixed, eager, atol=1e-5, rtol=1e-5)


def test_bf16_static_step_stays_close(make_model):
    model = make_model("micro").to(torch.bfloat16)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    eager, fixed = _decode_both_ways(model, prompt, steps=4, capacity=16)
    assert fixed.dtype == eager.dtype
    torch.testing.assert_close(fixed.float(), eager.float(), atol=3e-2, rtol=3e-2)


def test_a_cache_longer_than_the_capacity_is_refused(make_model):
    model = make_model("micro")
    cache = model.new_cache()
    with torch.inference_mode():
        model.hidden_states(torch.tensor([[1, 2, 3, 4]]), cache)
    with pytest.raises(ZayaError, match="more than the capacity 3"):
        StaticCache.from_cache(cache, 3)


def test_capacities_are_rounded_up():
    assert round_capacity(1) == round_capacity(256) == 256
    assert round_capacity(257) == 512


@pytest.mark.slow
def test_compiled_generation_gives_the_eager_tokens(make_model):
    model = make_model("micro", num_hidden_layers=2)  # the first block and one with EDA: a smaller C++ build
    decoder = CompiledDecoder(model)
    prompt = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(model, prompt, 20, decoder=decoder), generate(model, prompt, 20))
    sampling = Sampling(greedy=False, temperature=1.2, top_p=0.9, seed=7)
    assert torch.equal(generate(model, prompt, 20, sampling, decoder=decoder), generate(model, prompt, 20, sampling))
    # a decoder serves the model's current weights, not those it was compiled with
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    assert torch.equal(generate(model, prompt, 20, decoder=decoder), generate(model, prompt, 20))
    # (a batch of one row, another graph, is `zaya generate --compile` in tests/test_cli.py: one compile fewer here)


def test_a_decoder_serves_only_its_model(make_model):
    decoder = CompiledDecoder(make_model("micro"))
    with pytest.raises(ZayaError, match="another model"):
        generate(make_model("micro", seed=1), torch.tensor([[1, 2]]), 3, decoder=decoder)
