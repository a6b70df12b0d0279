"""Parity with transformers' ZayaForCausalLM (the test oracle) and the HF layouts, native and legacy."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, ZayaForCausalLM
from transformers import ZayaConfig as HFZayaConfig

import zaya
from modeling import legacy_config_json
from zaya.infer.generate import generate
from zaya.model.config import ZayaConfig
from zaya.model.hf import save_hf_state

CONFIGS = {
    "micro": zaya.get_preset("micro", temp_init=1.0),
    "wide-groups-kernel3": ZayaConfig(
        vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, num_experts=3, moe_intermediate_size=24, router_hidden_size=16, cca_time0=3, cca_time1=2,
        rope_theta=500.0, temp_init=1.0),
    "mha-full-rope": ZayaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        head_dim=32, num_experts=5, moe_intermediate_size=32, router_hidden_size=24, cca_time1=3,
        partial_rotary_factor=1.0, temp_init=1.5),
    "four-kv-heads": ZayaConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, num_experts=6, moe_intermediate_size=40, router_hidden_size=32, rms_norm_eps=1e-6,
        temp_init=0.7),
}


def _hf_load(directory):
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_continuation_match_transformers(make_model, tmp_path, name):
    ours = make_model(CONFIGS[name], seed=7)
    zaya.export_hf(ours, tmp_path / "hf")
    theirs = _hf_load(tmp_path / "hf")
    ids = torch.randint(0, ours.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)
    prompt = ids[:1, :6]
    expected = theirs.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, 16).tolist() == expected[:, 6:].tolist()


def test_weights_initialised_by_transformers_load_to_the_same_logits(tmp_path):
    torch.manual_seed(0)
    config = HFZayaConfig(vocab_size=200, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=16,
                          router_hidden_size=8, max_position_embeddings=256)
    theirs = ZayaForCausalLM(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    theirs.save_pretrained(tmp_path / "hf")
    ours = zaya.load_model(tmp_path / "hf", device="cpu")
    ids = torch.randint(0, 200, (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)


def test_round_trip_hf_to_zaya_to_hf_is_bit_exact(tmp_path):
    torch.manual_seed(1)
    config = HFZayaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=3, moe_intermediate_size=16,
                          router_hidden_size=8)
    model = ZayaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
        model.model.layers[1].mlp.gate.balancing_biases.copy_(torch.randn(4))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "a")
    zaya.convert(tmp_path / "a", tmp_path / "ckpt")
    zaya.convert(tmp_path / "ckpt", tmp_path / "b")
    before, after = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(before) == set(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key], tensor), key
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", ["micro", "four-kv-heads"])
def test_synthetic_legacy_checkpoint_imports_to_the_same_logits(make_model, tmp_path, name):
    native = make_model(CONFIGS[name], seed=11)
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    save_hf_state(legacy_dir, native.state_dict(), native.config, layout="legacy")
    (legacy_dir / "config.json").write_text(json.dumps(legacy_config_json(native.config)))
    keys = set(load_file(legacy_dir / "model.safetensors"))
    L = native.config.num_hidden_layers
    assert f"model.layers.{2 * L - 1}.zaya_block.experts.local_experts.0.linear_fc1.weight" in keys
    assert "model.layers.1.zaya_block.router.router_states_scale" not in keys
    assert "model.layers.0.res_scale.residual_scale" not in keys and "model.res_scale.residual_bias" in keys
    imported = zaya.load_model(legacy_dir, device="cpu")
    assert imported.config.skip_route == "identity"
    ids = torch.randint(0, native.config.vocab_size, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(imported(ids), native(ids), atol=1e-6, rtol=0)
    # and on through the converter into our format and out as native HF
    zaya.convert(legacy_dir, tmp_path / "ckpt", layout="legacy")
    zaya.convert(tmp_path / "ckpt", tmp_path / "native")
    with torch.no_grad():
        torch.testing.assert_close(_hf_load(tmp_path / "native")(ids).logits, native(ids), atol=1e-5, rtol=0)
