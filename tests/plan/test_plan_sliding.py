"""The plan of a model with sliding-window blocks (`hybrid_sliding`): their attention FLOPs are the pairs the
window allows, their kernel's work the tiles of its band, a window as long as the row plans as `hybrid`, a
shorter one plans less attention and a smaller decode cache but no less training memory (the fused kernels
keep nothing of T^2 either way), split over cp ranks a window within the chunk before sends a halo instead of
the keys; the activations, the band's masks, the decode cache and the operators counted match the model's, and
`zaya plan` and its search take a run config that sets them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runs import ZAYA1_BASE_HAND
from zaya.cli import main
from zaya.config import load_config
from zaya.model.config import ZayaConfig
from zaya.model.flops import attended_positions, attention_flops_per_token, training_flops_per_token
from zaya.model.masks import DocumentLayout, allowed, band_mask, segment_work
from zaya.model.presets import get_preset
from zaya.model.transformer import Zaya
from zaya.plan.calibrate import measure_elementwise
from zaya.plan.devices import get_device
from zaya.plan.documents import DocumentPlan, causal_pairs, document_pairs, window_work
from zaya.plan.layout import Layout
from zaya.plan.measure import activation_bytes as measured_bytes
from zaya.plan.memory import (
    DeviceDetails,
    activation_bytes,
    band_shapes,
    decode_cache_bytes,
    memory_per_gpu,
    window_mask_bytes,
)
from zaya.plan.planner import plan_run
from zaya.plan.search import search_layouts
from zaya.plan.timing import RooflineRates, attention_seconds, op_counts, step_time
from zaya.plan.traffic import Traffic, step_traffic

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "zaya1-base.toml"
CPU = {"fp32": DeviceDetails(1, 1 << 21), "bf16": DeviceDetails(32, 1 << 21)}  # as zaya.plan.compare's


def _types(pattern: list[str], blocks: int) -> str:
    """A TOML list of `blocks` block types repeating `pattern`."""
    return json.dumps([pattern[i % len(pattern)] for i in range(blocks)])


def _sliding(config: ZayaConfig, window: int, pattern: tuple[str, ...] = ("hybrid_sliding",)) -> ZayaConfig:
    types = [pattern[i % len(pattern)] for i in range(config.num_hidden_layers)]
    return ZayaConfig(**{**config.to_dict(), "layer_types": types, "sliding_window": window})


# ---- attention work -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("T", "W"), [(1, 1), (7, 1), (100, 3), (100, 64), (100, 100), (100, 500), (4096, 1000)])
def test_the_flops_of_a_sliding_block_are_the_pairs_its_window_allows(T, W):
    model = get_preset("micro")
    one = ZayaConfig(**{**model.to_dict(), "num_hidden_layers": 1})
    pairs = int(allowed(0, T, 0, T, torch.zeros(T, dtype=torch.long), W).sum()) if T <= 100 else \
        DocumentLayout(((0,),), T, W).pairs()  # the mask's own rule, or the kernel plan's count of it
    per_pair = 4 * model.num_attention_heads * model.head_dim
    assert attention_flops_per_token(_sliding(one, W), T) * T == pytest.approx(per_pair * pairs, rel=1e-12)
    assert attention_flops_per_token(one, T) * T == pytest.approx(per_pair * T * (T + 1) / 2, rel=1e-12)
    # blocks add up by type: 2 sliding, 1 hybrid
    mixed = _sliding(model, W, ("hybrid_sliding", "hybrid_sliding", "hybrid"))
    assert attention_flops_per_token(mixed, T) == pytest.approx(
        per_pair * (2 * attended_positions(T, W) + attended_positions(T)), rel=1e-12)


@pytest.mark.parametrize(("T", "W"), [(100, 3), (4096, 64), (4096, 1000), (4096, 4096), (131072, 4096)])
def test_the_kernel_work_of_a_band_is_its_tiles_and_no_less_than_its_pairs(T, W):
    plan = DocumentLayout(((0,),), T, W)
    assert window_work(T, W) == segment_work(plan.segments(), 1) >= plan.pairs()
    assert causal_pairs(T, W) == window_work(T, W)
    if W >= T:
        assert window_work(T, W) == T * (T + 1) // 2 == causal_pairs(T)
    # each document of a row under the window, as the kernel plan runs them
    docs = DocumentLayout((tuple(range(0, T, 512)),), T, W)
    if T % 512 == 0:
        assert document_pairs(T, 512, W) == segment_work(docs.segments(), 1)


def test_attention_time_follows_the_kernel_work_per_block_type():
    model = get_preset("zaya1-base", max_position_embeddings=131072)
    rates = RooflineRates({"bf16": 1e15}, 5e12, 0.5)
    T, W = 131072, 4096
    causal = attention_seconds(model, rates, T, 1, 8, "bf16", 3)
    band = attention_seconds(model, rates, T, 1, 8, "bf16", 3, window=W)
    assert band / causal == pytest.approx(window_work(T, W) / (T * (T + 1) / 2), rel=1e-12)
    chats = attention_seconds(model, rates, T, 1, 8, "bf16", 3, DocumentPlan(8192, "test"), window=W)
    assert chats / causal == pytest.approx(T / 8192 * window_work(8192, W) / (T * (T + 1) / 2), rel=1e-12)
    # a step's attention is the blocks' sum: 30 sliding, 10 full
    mixed = _sliding(model, W, ("hybrid_sliding",) * 3 + ("hybrid",))
    layout = Layout(8, 8, 1, 1, 8, 1, "none")
    parts = [step_time(config, layout, T, "bf16", 1, rates, Traffic(), {}).attention for config in (model, mixed)]
    assert parts[1] == pytest.approx(parts[0] * (10 + 30 * band / causal) / 40, rel=1e-12)


# ---- one plan against the other -----------------------------------------------------------------------------

def test_a_window_as_long_as_every_row_plans_as_all_hybrid():
    blocks = get_preset("zaya1-base").num_hidden_layers
    sliding = [f"model.layer_types={_types(['hybrid_sliding'], blocks)}", "model.sliding_window=131072"]
    hybrid, windowed = (plan_run(load_config(BASE, sets).resolve(64), get_device("h100")).to_dict()
                        for sets in ([], sliding))
    assert windowed.pop("sliding") == {"blocks": blocks, "of": blocks, "window": 131072}
    assert hybrid.pop("sliding") is None
    assert windowed == hybrid  # every phase: memory, traffic, time, hours, decode cache


def test_a_shorter_window_plans_less_attention_and_decode_cache_but_no_less_training_memory():
    T, W = 32768, 4096
    base = [*ZAYA1_BASE_HAND, f"data.seq_len={T}", "model.max_position_embeddings=32768", "parallel.cp=8",
            "phases=[]"]
    blocks = get_preset("zaya1-base").num_hidden_layers
    sliding = [f"model.layer_types={_types(['hybrid_sliding'] * 3 + ['hybrid'], blocks)}",
               f"model.sliding_window={W}"]
    runs = [load_config(BASE, [*base, *sets]).resolve(64) for sets in ([], sliding)]
    hybrid, windowed = (plan_run(run, get_device("h100")) for run in runs)
    model = runs[1].model
    h, s = hybrid.first, windowed.first
    assert s.time.attention < 0.5 * h.time.attention and s.time.total < h.time.total
    assert s.time.gemm == h.time.gemm
    assert windowed.flops_per_token < hybrid.flops_per_token
    assert s.decode_cache == decode_cache_bytes(model, T) < 0.4 * h.decode_cache
    # the attention's activations are O(T) either way (chunks of 2,048 < W - 1: the all-gather kernel runs
    # both): the sliding blocks' own RoPE tables are all they add, and their band's masks, kept
    assert s.memory.activations - h.memory.activations == 2 * (T // 8) * model.head_dim * 4
    assert s.traffic.by_kind == h.traffic.by_kind
    masks = window_mask_bytes(model, T, 8, "bf16")
    assert s.memory.transient - h.memory.transient == masks == 2047 * 2047 * 3  # a chunk and the one two before


def test_a_window_within_the_chunk_before_sends_a_halo_instead_of_the_keys():
    model = _sliding(get_preset("micro"), 6, ("hybrid", "hybrid_sliding", "hybrid_sliding"))
    T, B, kv = 128, 2, 2 * model.key_latent  # head-tail over 2 ranks: chunks of 32, one tail leaves each rank
    for mode, passes in (("none", 1), ("full", 2)):
        layout = Layout(2, 2, 1, 1, 2, B, mode)
        sent = step_traffic(model, layout, T, "fp32", 3).by_kind
        whole = step_traffic(_sliding(model, 40, ("hybrid", "hybrid_sliding", "hybrid_sliding")), layout, T, "fp32",
                             3).by_kind  # W - 1 > 32: the all-gather kernel, every layer's keys
        assert sent["cp_window_kv"] == 3 * 2 * passes * B * 5 * kv * 4
        assert sent["cp_window_dkv"] == 3 * 2 * B * 5 * kv * 4
        assert sent["cp_kv"] == whole["cp_kv"] / 3 and "cp_window_kv" not in whole
    # the halo kernel keeps what it received: 2 chunks' 5 keys and values per row and sliding block
    saved = [activation_bytes(config, B * T // 2, T, 2, "fp32", "none")[0]
             for config in (model, _sliding(model, 40, ("hybrid", "hybrid_sliding", "hybrid_sliding")))]
    assert saved[0] - saved[1] == 2 * B * 2 * 5 * kv * 4


def test_one_device_sliding_blocks_keep_a_copy_of_their_output_and_their_band_masks():
    model = get_preset("zaya1-base")
    T, W = 8192, 2048
    windowed = _sliding(model, W)  # every block: one set of RoPE tables, as the all-hybrid model
    layout = Layout(1, 1, 1, 1, 1, 1, "none")
    full, band = (memory_per_gpu(config, layout, T, "bf16") for config in (model, windowed))
    assert band.activations - full.activations == model.num_hidden_layers * T * model.query_latent * 2
    tile = 512  # the first W / tile tiles reach back to the row's start, the others alike
    assert band.transient - full.transient == window_mask_bytes(windowed, T, 1, "bf16") == \
        3 * tile * (sum(range(tile, W + 1, tile)) + tile + W - 1)
    assert window_mask_bytes(_sliding(model, T), T, 1, "bf16") == window_mask_bytes(model, T, 1, "bf16") == 0


# ---- against the model --------------------------------------------------------------------------------------

def _saved(config, ids: torch.Tensor, precision: str) -> int:
    torch.manual_seed(0)
    model = Zaya(config)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        return measured_bytes(functools.partial(model.loss, ids[:, :-1], ids[:, 1:]), model)[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activations_of_sliding_blocks_match_what_autograd_saves(precision):
    hybrid = get_preset("micro", temp_init=1.0)
    config = _sliding(hybrid, 64, ("hybrid_sliding", "hybrid_sliding", "hybrid"))
    B, T = 2, 512
    ids = torch.randint(2, config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    saved = [_saved(c, ids, precision) for c in (hybrid, config)]
    predicted = [activation_bytes(c, B * T, T, 1, precision, "none", CPU[precision])[0] for c in (hybrid, config)]
    # within the tolerance of tests/plan/test_accuracy.py; and what the sliding blocks add (W_o's copy of the band
    # operator's output, their RoPE tables) within 10% (fp32: 0.1%; bf16 keeps a few small tensors more)
    assert predicted[1] / saved[1] == pytest.approx(1, abs=0.08)
    assert (predicted[1] - predicted[0]) / (saved[1] - saved[0]) == pytest.approx(1, abs=0.1)


def test_the_band_masks_planned_are_those_the_model_makes():
    config = _sliding(get_preset("micro", temp_init=1.0), 64, ("hybrid_sliding", "hybrid"))
    T = 500  # a last tile of its own shape
    band_mask.cache_clear()
    ids = torch.randint(2, config.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    Zaya(config).loss(ids[:, :-1], ids[:, 1:]).backward()
    made = band_mask.cache_info().currsize
    planned = band_shapes([DocumentLayout(((0,),), T, 64).segments()])
    assert made == len(planned) == 3
    for queries, keys, offset in planned:  # each already made: a hit, nothing new
        band_mask(queries, keys, offset, 64, torch.device("cpu"))
    assert band_mask.cache_info().currsize == made and band_mask.cache_info().hits >= len(planned)


def test_the_decode_cache_planned_is_what_the_sliding_blocks_hold():
    config = _sliding(get_preset("micro"), 8)  # every block a ring of 8 positions: no buffer grown ahead
    model = Zaya(config).eval()
    cache = model.new_cache()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=cache)
        for step in range(3):
            model(ids[:, step:step + 1], cache=cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values, layer.conv_state, layer.value_state))
    assert held == decode_cache_bytes(config, 19, 2, "fp32")
    assert decode_cache_bytes(config, 19) == decode_cache_bytes(config, 10**6)  # flat past the window


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [8, 1000])  # the band's kernel (shorter than the 32 tokens counted), or SDPA's
def test_the_operators_of_a_mixed_model_are_those_its_counts_predict(window):
    types = ["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"]
    small = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 2, "moe_intermediate_size": 32, "router_hidden_size": 16,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
    config = ZayaConfig(**{**get_preset("micro").to_dict(), **small, "num_hidden_layers": len(types),
                           "layer_types": types, "sliding_window": window})
    ops = op_counts(config)
    torch.manual_seed(0)
    model = Zaya(config)
    ids = torch.randint(0, config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    with _Count() as count:
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
    assert ops.per_block * len(types) + ops.outside == pytest.approx(count.calls, rel=1e-12)
    hybrid = op_counts(ZayaConfig(**{**config.to_dict(), "layer_types": None, "sliding_window": None}))
    assert (ops.per_block != hybrid.per_block) == (window < 32)


# ---- the command and its search -----------------------------------------------------------------------------

def test_zaya_plan_takes_a_run_config_whose_model_sets_sliding_blocks(capsys, tmp_path):
    blocks = get_preset("small").num_hidden_layers
    text = (ROOT / "configs" / "small.toml").read_text(encoding="utf-8").replace(
        "[model]\n", f"[model]\nlayer_types = {_types(['hybrid_sliding', 'hybrid'], blocks)}\nsliding_window = 128\n",
        1)
    path = tmp_path / "sliding.toml"
    path.write_text(text, encoding="utf-8")
    config = load_config(path)
    model, seq = config.model.build(str(path)), config.data.seq_len
    assert model.sliding_blocks == blocks // 2 and seq > 128
    assert main(["plan", str(path), "--device", "h100", "--gpus", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["sliding"] == {"blocks": blocks // 2, "of": blocks, "window": 128}
    assert plan["flops_per_token"] == pytest.approx(training_flops_per_token(model, seq), rel=1e-12)
    hybrid = ZayaConfig(**{**model.to_dict(), "layer_types": None, "sliding_window": None})
    assert plan["flops_per_token"] < training_flops_per_token(hybrid, seq)
    assert plan["phases"][0]["decode_cache_per_sequence"] == decode_cache_bytes(model, seq)
    assert main(["plan", str(path), "--device", "h100", "--gpus", "8"]) == 0
    assert f"attention: {blocks // 2} of {blocks} blocks within a sliding window of 128 positions" in \
        capsys.readouterr().out


def test_the_search_ranks_the_layouts_of_a_sliding_model_by_its_cheaper_attention():
    blocks = get_preset("zaya1-base").num_hidden_layers
    base = [*ZAYA1_BASE_HAND, "data.seq_len=32768", "model.max_position_embeddings=32768", "phases=[]",
            "train.global_batch_size=4", "data.ramp_start=0"]
    sliding = [f"model.layer_types={_types(['hybrid_sliding'] * 3 + ['hybrid'], blocks)}", "model.sliding_window=4096"]
    best = {}
    for name, sets in (("hybrid", base), ("sliding", [*base, *sliding])):
        ranked = search_layouts(load_config(BASE, sets).resolve(4), 4, get_device("mi300x"))
        fitting = [c for c in ranked if not c.reason]
        assert fitting, name
        best[name] = fitting[0]
    assert best["sliding"].hours < best["hybrid"].hours


class _Rates(RooflineRates):
    dtype = "fp32"  # what `measure_elementwise` reads of a measured table besides its rates


def test_the_elementwise_calibration_takes_a_preset_with_sliding_blocks():
    """`zaya shapes` calibrates on the preset and on one block of it (of the first block's type): a step predicted
    over the cap returns before the model runs."""
    rates = _Rates({"bf16": 1e12, "fp32": 1e12}, 1e11, 0.5)
    assert measure_elementwise("zaya1-sliding", rates, torch.device("cpu"), 64, cap_s=0.0) is None
