"""Decoding a model with sliding-window blocks: the eager ring cache, the static (compiled) step and the
sharded decoder give transformers' greedy tokens and logits past the window; a sliding block's cache stays W
positions however long the generation; a sharded decoder reads no shard the window does not reach."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import zaya
from modeling import perturb
from ranks import run_distributed
from zaya.infer.generate import Sampling, generate
from zaya.infer.static import CompiledDecoder, StaticCache, decode_step
from zaya.infer.tree import KERNELS, ShardedDecoder, generate_sharded
from zaya.model.attention import DecodeCache
from zaya.parallel.comm import CommCounter

S, H = "hybrid_sliding", "hybrid"
TYPES = [S, H, S]
W = 5  # >= 2: transformers' own cached generation is wrong for W = 1
PROMPT = 9  # longer than the window
NEW = 34


def _config(**overrides) -> zaya.ZayaConfig:
    return zaya.get_preset("micro", **{"temp_init": 1.0, "layer_types": TYPES, "sliding_window": W,
                                       "sliding_rope_theta": 100.0, "sliding_partial_rotary_factor": 0.25, **overrides})


def _model(scale: float = 0.5, **overrides) -> zaya.Zaya:
    # perturbed well off its initial values: greedy decoding of a near-initial model repeats one token
    return perturb(zaya.build_model(_config(**overrides), seed=0), scale=scale).eval()


def _prompt(batch: int = 2, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def _eager(model, prompt, tokens):
    """Logits after the prompt and after each of `tokens` [B, n] but the last, through the eager ring cache."""
    cache = model.new_cache()
    logits = [model(prompt, cache)[:, -1]]
    logits += [model(tokens[:, t:t + 1], cache)[:, -1] for t in range(tokens.shape[1] - 1)]
    return torch.stack(logits, dim=1), cache


@torch.inference_mode()
def _prefilled(model, prompt, capacity):
    """The logits after the prompt [B, V] and the prompt's cache copied into a static one."""
    cache = model.new_cache()
    logits = model(prompt, cache)[:, -1]
    return logits, StaticCache.from_cache(cache, capacity)


@torch.inference_mode()
def _static_greedy(model, prompt, steps, capacity, static=None):
    """Greedy tokens and their logits [B, n, V] through `decode_step` (eager) on a static cache (`static`, the
    prompt's, if given), and the cache."""
    first, prefilled = _prefilled(model, prompt, capacity)
    static = static if static is not None else prefilled
    logits, tokens = [first], [first.argmax(-1)]
    for i in range(steps - 1):
        logits.append(decode_step(model, tokens[-1], torch.tensor(prompt.shape[1] + i), static))
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), static


def test_greedy_decoding_past_the_window_matches_transformers(tmp_path):
    model = _model()
    prompt = _prompt()
    ours = generate(model, prompt, NEW)
    assert len(set(ours.flatten().tolist())) > 4  # not one repeated token
    static_tokens, static_logits, _ = _static_greedy(model, prompt, NEW, capacity=PROMPT + NEW)
    assert torch.equal(static_tokens, ours)
    eager_logits, _ = _eager(model, prompt, ours)
    scale = eager_logits.abs().max().item()  # logits of a few tens: a bound relative to them
    torch.testing.assert_close(static_logits, eager_logits, atol=2e-6 * scale, rtol=0)

    zaya.export_hf(model, tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():  # the oracle's logits along our tokens: its greedy choice at every step is ours
        oracle = theirs(torch.cat([prompt, ours], dim=1)).logits[:, PROMPT - 1:-1]
    assert torch.equal(oracle.argmax(-1), ours)
    torch.testing.assert_close(eager_logits, oracle, atol=1e-5 * scale, rtol=0)


def test_a_sliding_blocks_cache_stays_w_positions():
    model = _model()
    slots = {i: (W if t == S else None) for i, t in enumerate(TYPES)}
    # static: the sliding blocks' rings have W slots, whatever the capacity, and decoding writes into them
    # in place (the graph's buffers: the same storage however many steps)
    for capacity in (512, PROMPT + 12):
        static = _prefilled(model, _prompt(1), capacity)[1]
        assert [k.shape[2] for k in static.keys] == [slots[i] or capacity for i in slots]
        assert [v.shape[2] for v in static.values] == [k.shape[2] for k in static.keys]
    buffers = [k.data_ptr() for k in static.keys]
    _static_greedy(model, _prompt(1), 12, capacity=PROMPT + 12, static=static)  # 2 W past the prompt
    assert [k.shape[2] for k in static.keys] == [W, PROMPT + 12, W]
    assert [k.data_ptr() for k in static.keys] == buffers
    # a capacity under the window: the ring never fills, and needs no more slots than the capacity
    tokens, logits, static = _static_greedy(model, _prompt(1, 2), 2, capacity=3)
    assert [k.shape[2] for k in static.keys] == [3, 3, 3]
    torch.testing.assert_close(logits, _eager(model, _prompt(1, 2), tokens)[0], atol=1e-5, rtol=1e-5)
    # eager: the ring is allocated once, W slots, and holds the last W positions in slot p mod W
    cache = model.new_cache()
    ids = torch.cat([_prompt(1), _prompt(1, 16)], dim=1)
    with torch.inference_mode():
        model(ids[:, :PROMPT], cache)
        rings = [layer.keys.data_ptr() for layer in cache.layers]
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t:t + 1], cache)
        # block 0's keys depend on the tokens alone (no attention before it): all of them, in one pass
        every = model.blocks[0].attn.project(model.blocks[0].attn_norm(model.embed_scaling(model.embed(ids))),
                                             model.rope(torch.arange(ids.shape[1]))[S])[1]
    for i, layer in enumerate(cache.layers):
        if slots[i] is None:
            assert layer.keys.shape[2] >= ids.shape[1]
            continue
        assert layer.keys.shape[2] == W and layer.keys.data_ptr() == rings[i] and layer.length == ids.shape[1]
    keys, _, first = cache.layers[0].ordered()
    assert first == ids.shape[1] - W
    torch.testing.assert_close(keys, every[:, :, first:], atol=1e-5, rtol=0)  # a wrong slot: O(1)


@pytest.mark.slow
def test_compiled_greedy_decoding_gives_the_eager_tokens():
    # two blocks (one sliding, one full): the compile builds the smallest graph that has both
    model = _model(num_hidden_layers=2, layer_types=[S, H])
    prompt = _prompt()
    decoder = CompiledDecoder(model)
    compiled = generate(model, prompt, NEW, decoder=decoder)
    assert torch.equal(compiled, generate(model, prompt, NEW))
    assert torch.equal(compiled, _static_greedy(model, prompt, NEW, capacity=PROMPT + NEW)[0])


# ---- sharded over 2 ranks ------------------------------------------------------------------------------------

SPLIT = 10  # of a 12-token prompt: rank 0 holds positions 0..9, the owner 10..11 and every new token
STEPS = 6


def _fp64_model() -> zaya.Zaya:
    return _model(fp32_logits=False).double()


@torch.inference_mode()
def _shard_caches(model, ids, rank: int) -> DecodeCache:
    """This rank's shard of the prompt's caches, filled from one process's (`ShardedDecoder.attach`): rank 0's
    rings hold positions 0..SPLIT-1 as their own 0..SPLIT-1, the owner's the rest, with its convolution and
    value-shift states."""
    windows = [block.window for block in model.blocks]
    whole = DecodeCache(len(windows))  # every position's keys
    model(ids, whole)
    part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, ids.shape[1])
    cache = DecodeCache(len(windows), windows)
    for ours, source in zip(cache.layers, whole.layers, strict=True):
        ours.append(source.keys[:, :, part], source.values[:, :, part])
        if rank == 1:
            ours.conv_state, ours.value_state = source.conv_state, source.value_state
    return cache


def _sharded_worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    model = _fp64_model()
    ids = torch.randint(0, 512, (2, 12 + STEPS), generator=torch.Generator().manual_seed(3))
    reference = model.new_cache()
    with torch.inference_mode():
        model(ids[:, :12], reference)
        expected = [model(ids[:, t:t + 1], reference)[:, -1] for t in range(12, ids.shape[1])]
    report = {}
    for kernel in KERNELS:
        counter = CommCounter()
        decoder = ShardedDecoder(model, kernel=kernel, counter=counter)
        decoder.attach(_shard_caches(model, ids[:, :12], rank), 12)
        steps = []
        for t, logits in zip(range(12, ids.shape[1]), expected, strict=True):
            before = list(decoder.attended)
            diff = (decoder.step(ids[:, t]) - logits).abs().max().item()
            steps.append((diff, [a - b for a, b in zip(decoder.attended, before, strict=True)], counter.take()))
        report[kernel] = steps
    # generate_sharded over a sharded prefill (3 + 3 tokens, the 7th by the decode step) against one process
    model32 = _model(scale=1.0)
    prompt = _prompt(length=7)
    sampled = Sampling(greedy=False, temperature=1.0, top_p=0.9, seed=3)
    report["tokens"] = {(kernel, name): (generate_sharded(model32, prompt, 12, sampling, kernel=kernel).tolist(),
                                         generate(model32, prompt, 12, sampling).tolist())
                        for kernel in KERNELS for name, sampling in (("greedy", None), ("sampled", sampled))}
    return report


def _expected_reach(rank: int, step: int) -> list[int]:
    """The keys rank `rank` reads per block at decode step `step`: a full block all its shard's, a sliding one
    those of positions P - W + 1 .. P (P = 12 + step)."""
    position = 12 + step
    first = position - W + 1
    if rank == 0:
        return [max(0, SPLIT - first) if t == S else SPLIT for t in TYPES]
    held = 12 - SPLIT + step + 1
    return [min(held, W) if t == S else held for t in TYPES]


@pytest.mark.slow
def test_sharded_decoding_reads_only_the_shards_the_window_reaches():
    reports = run_distributed(_sharded_worker, 2, timeout=120)
    config = _config()
    B, Hq, Hk, d = 2, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for rank, report in enumerate(reports):
        for kernel in KERNELS:
            for step, (diff, read, sent) in enumerate(report[kernel]):
                where = (kernel, rank, step)
                assert diff <= 1e-10, where
                reach = [_expected_reach(r, step) for r in range(2)]
                # rank 0's shard is reached by the sliding blocks at the first two steps only (2 keys, then 1)
                owner_alone = [t == S and reach[0][i] == 0 for i, t in enumerate(TYPES)]
                if kernel == "tree":
                    assert read == reach[rank], where
                else:  # every reached shard comes by every rank, unless the owner attends alone
                    assert read == [(reach[1][i] if rank == 1 else 0) if alone else reach[0][i] + reach[1][i]
                                    for i, alone in enumerate(owner_alone)], where
                assert owner_alone == [False, False, False] if step < 2 else [True, False, True], where
                # bytes: the query or (the owner alone) the output, broadcast from the owner: rank 0 is the last
                # of the chain and sends nothing; the tree's two all-reduces, or the ring's shards, for the rest
                expected = {}
                if rank == 1:
                    expected["query"] = sum(not alone for alone in owner_alone) * B * Hq * d * 8
                    expected["window_out"] = sum(owner_alone) * B * Hq * d * 8
                if kernel == "tree":
                    combined = sum(not alone for alone in owner_alone)
                    expected["tree_max"] = combined * B * Hq * 8
                    expected["tree_sum"] = combined * B * Hq * (d + 1) * 8
                else:
                    expected["ring_kv"] = sum(reach[rank][i] for i, alone in enumerate(owner_alone)
                                              if not alone) * B * Hk * d * 2 * 8
                assert sent == {kind: n for kind, n in expected.items() if n}, where
        for (kernel, name), (ours, theirs) in report["tokens"].items():
            assert ours == theirs, (kernel, name, rank)

