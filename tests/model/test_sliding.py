"""Sliding-window blocks (`layer_types` "hybrid_sliding"): parity with transformers' ZayaForCausalLM (the test
oracle) for mixed block types, windows below and above the sequence, RoPE per type, grouped and full heads;
the window's cost following W, not T; packed documents under a window; the decode cache's ring; compiled
blocks; and the one-line refusals of configs neither transformers nor zaya can run."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters
from transformers import ZayaConfig as HFZayaConfig
from transformers import ZayaForCausalLM

import zaya
from host_syncs import HostSyncs
from zaya.errors import ZayaError
from zaya.infer.generate import generate
from zaya.model.config import ZayaConfig
from zaya.model.documents import packed_documents
from zaya.model.hf_config import config_from_native
from zaya.model.masks import segment_work, window_segments

EOS = 1


def _hf_model(layer_types, window, *, heads=4, kv_heads=2, thetas=(1e6, 100.0), factors=(0.5, 0.25), seed=0):
    config = HFZayaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=len(layer_types), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, num_experts=3, moe_intermediate_size=16, router_hidden_size=8,
        layer_types=layer_types, sliding_window=window, max_position_embeddings=512,
        rope_parameters={
            "hybrid": {"rope_type": "default", "rope_theta": thetas[0], "partial_rotary_factor": factors[0]},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": thetas[1], "partial_rotary_factor": factors[1]},
        })
    torch.manual_seed(seed)
    model = ZayaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _oracles_choices(model, sequence, prompt_len):
    """transformers' greedy choice after each prefix of `sequence` past the prompt, from one forward over it (its
    causal, windowed mask: no cache of its own). Equal to the tokens after the prompt iff its greedy decoding of
    the prompt gives them, by induction over the steps."""
    with torch.no_grad():
        return model(sequence).logits[:, prompt_len - 1:-1].argmax(-1)


S, H = "hybrid_sliding", "hybrid"
CASES = {  # layer types, window, query heads, KV heads
    "all-sliding-window-5": ([S, S, S], 5, 4, 2),
    "alternating-window-7-four-kv": ([H, S, H, S], 7, 4, 4),
    "first-only-window-above-sequence": ([S, H, H], 100, 4, 2),
    "full-heads-window-2": ([S, H], 2, 2, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_decoding_match_transformers(tmp_path, name):
    layer_types, window, heads, kv_heads = CASES[name]
    theirs = _hf_model(layer_types, window, heads=heads, kv_heads=kv_heads, seed=len(name))
    theirs.save_pretrained(tmp_path / "hf")
    ours = zaya.load_model(tmp_path / "hf", device="cpu")
    assert [block.window for block in ours.blocks] == [window if t == S else None for t in layer_types]
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)
    prompt = ids[:, :12]  # longer than every window but the one above the sequence
    tokens = generate(ours, prompt, 32)
    assert tokens.tolist() == _oracles_choices(theirs, torch.cat([prompt, tokens], dim=1), 12).tolist()


def test_round_trip_hf_to_zaya_to_hf_keeps_weights_and_config(tmp_path):
    theirs = _hf_model([S, H, S], 6, thetas=(5e6, 1e4), factors=(0.5, 0.5))
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "a")
    zaya.convert(tmp_path / "a", tmp_path / "ckpt")
    zaya.convert(tmp_path / "ckpt", tmp_path / "b")
    before, after = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(before) == set(after)
    assert all(torch.equal(after[key], tensor) and after[key].dtype == tensor.dtype for key, tensor in before.items())
    a, b = (HFZayaConfig.from_pretrained(tmp_path / d) for d in "ab")
    for field in ("layer_types", "sliding_window", "rope_parameters", "num_hidden_layers", "head_dim"):
        assert getattr(a, field) == getattr(b, field), field


def test_the_hubs_two_rope_forms_read_alike(tmp_path):
    """Nested per type, and nested with a stray top-level rope_type (transformers drops it): the same config; a
    type's entry without a partial_rotary_factor rotates the whole head, as transformers does."""
    base = dict(model_type="zaya", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=2, moe_intermediate_size=16, router_hidden_size=8,
                layer_types=[H, S], sliding_window=3, eos_token_id=1)
    nested = {H: {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
              S: {"rope_type": "default", "rope_theta": 1e4}}
    one = config_from_native({**base, "rope_parameters": nested}, tmp_path / "config.json")
    two = config_from_native({**base, "rope_parameters": {"rope_type": "default", **nested}}, tmp_path / "config.json")
    assert one == two
    assert (one.rope_theta, one.partial_rotary_factor, one.sliding_rope_theta, one.sliding_partial_rotary_factor) == (
        1e6, 0.5, 1e4, 1.0)
    warnings.simplefilter("ignore")
    hf = HFZayaConfig(**{k: v for k, v in base.items() if k != "model_type"}, rope_parameters=nested)
    assert hf.rope_parameters[S].get("partial_rotary_factor", 1.0) == one.sliding_partial_rotary_factor


BAD_CONFIGS = {  # change to a valid config.json -> what the one line names
    "a type that is neither": ({"layer_types": [H, "full_attention"]}, "layer_types[1] is 'full_attention'"),
    "no window": ({"sliding_window": None}, "'sliding_window' must be set"),
    "window 0": ({"sliding_window": 0}, "'sliding_window' must be a positive integer"),
    "window -3": ({"sliding_window": -3}, "'sliding_window' must be a positive integer"),
    "window as text": ({"sliding_window": "4"}, "'sliding_window' must be a positive integer"),
    "one type short": ({"layer_types": [S]}, "'layer_types' has 1 entries for num_hidden_layers = 2"),
    "no sliding rope": ({"rope_parameters": {H: {"rope_theta": 1e6}}}, "no 'hybrid_sliding' entry"),
    "flat rope with sliding blocks": ({"rope_parameters": {"rope_theta": 1e6}}, "no 'hybrid_sliding' entry"),
    "linear rope": ({"rope_parameters": {H: {"rope_theta": 1e6}, S: {"rope_type": "linear", "rope_theta": 1e4,
                                                                      "factor": 2.0}}}, "rope_type 'linear'"),
    "no rope_theta": ({"rope_parameters": {H: {"rope_theta": 1e6}, S: {}}}, "hybrid_sliding.rope_theta"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_config_json_that_cannot_run_is_one_line(tmp_path, name):
    change, said = BAD_CONFIGS[name]
    data = {**dict(model_type="zaya", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, num_experts=2, moe_intermediate_size=16, router_hidden_size=8,
                   layer_types=[H, S], sliding_window=3), **change}
    with pytest.raises(ZayaError) as error:
        config_from_native(data, tmp_path / "config.json")
    message = str(error.value)
    assert said in message and "\n" not in message and str(tmp_path / "config.json") in message


def test_a_sliding_blocks_attention_work_follows_the_window():
    """The plan of a row of T tokens under a window of W: O(T W) query-key pairs, no T x T mask; exactly the
    causal band's pairs once T is a multiple of the tiles."""
    W = 64
    works = {T: segment_work(window_segments(T, W).numpy(), 1) for T in (1024, 2048, 4096)}
    band = {T: W * (W + 1) // 2 + (T - W) * W for T in works}
    for T, work in works.items():
        assert band[T] <= work <= 2 * band[T]
        assert window_segments(T, W)[:, [2, 4]].sub(window_segments(T, W)[:, [1, 3]]).max() <= 2 * W
    assert works[4096] - works[2048] == pytest.approx(2 * (works[2048] - works[1024]), rel=0.01)


def _sliding_config(**overrides):
    return zaya.get_preset("micro", **{"temp_init": 1.0, "layer_types": [S, H, S], "sliding_window": 7,
                                       "sliding_rope_theta": 500.0, **overrides})


def test_packed_documents_under_a_window_compute_each_document_alone(make_model):
    model = make_model(_sliding_config()).double()
    generator = torch.Generator().manual_seed(4)
    docs = [torch.randint(3, 512, (n,), generator=generator) for n in (20, 3, 41, 9)]
    for doc in docs:
        doc[-1] = EOS
    row = torch.cat(docs)[None]
    documents = packed_documents(row, EOS, window=model.config.active_window)
    packed = model.hidden_states(row, documents=documents)
    packed[0].square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = torch.cat([model.hidden_states(d[None])[0] for d in docs])
    alone.square().sum().backward()
    torch.testing.assert_close(packed[0], alone, rtol=0, atol=1e-10)
    for grad, param in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=0, atol=1e-9)


def test_the_decode_cache_of_a_sliding_block_stays_w_positions(make_model):
    """Prefill past the window, chunks of several tokens, then single tokens: the same logits as one forward
    over the whole sequence, and a sliding block's keys held in W slots throughout."""
    model = make_model(_sliding_config())
    ids = torch.randint(0, 512, (2, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache()
        pieces = [model(ids[:, :20], cache), model(ids[:, 20:23], cache)]
        pieces += [model(ids[:, t:t + 1], cache) for t in range(23, 60)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=0)
    for block, layer in zip(model.blocks, cache.layers, strict=True):
        assert layer.length == 60
        assert layer.keys.shape[2] == (7 if block.window else layer.keys.shape[2])
        assert layer.stored == (7 if block.window else 60)


def test_sliding_blocks_compile_to_one_graph_each_and_never_read_the_device():
    """A sliding block's band (a host tensor planned outside the graph) through one custom op: every block one
    graph with no break, one graph per block type (and the first block's, without a router state) however deep,
    forward and backward as eager in fp32; and no host reads in eager either."""
    config = _sliding_config(num_hidden_layers=5, layer_types=[S, H, S, H, S])
    eager = zaya.build_model(config, seed=3).train()
    compiled = zaya.build_model(config, seed=3).train()
    batch = torch.randint(0, config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as syncs:
        eager.loss(batch[:, :-1], batch[:, 1:]).backward()
    assert syncs.ops == []
    torch._dynamo.reset()
    counters.clear()
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend="aot_eager")
    compiled.loss(batch[:, :-1], batch[:, 1:]).backward()
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 3
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_bf16_autocast_runs_a_sliding_block_close_to_fp32(make_model):
    model = make_model(_sliding_config())
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model.loss(batch[:, :-1], batch[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = model.loss(batch[:, :-1], batch[:, 1:])
    assert abs(half.item() - full.item()) < 0.05 * full.item()


def test_a_phase_raising_rope_theta_leaves_the_sliding_blocks_rope(make_model):
    model = make_model(_sliding_config())
    before = model.sliding_rotary.inv_freq.clone()
    model.set_rope_theta(1e6)
    assert torch.equal(model.sliding_rotary.inv_freq, before)
    assert model.config.rope_theta == 1e6 and model.config.sliding_rope_theta == 500.0


def test_the_config_round_trips_through_its_dict_and_json():
    config = _sliding_config()
    assert ZayaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.sliding_blocks == 2 and config.active_window == 7 and config.window(1) is None
    assert _sliding_config(layer_types=None).active_window is None
