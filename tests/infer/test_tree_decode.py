"""Decoding over a sequence-sharded KV cache (`zaya.infer.tree`): Tree Attention and the ring pass give one
process's logits at every step (fp64) and its tokens (fp32), the convolution and value-shift states live on the
last rank only, the bytes sent per token follow the kernels' formulas, and `zaya generate --shard-kv` under
torchrun prints what one process prints."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import zaya
from modeling import perturb
from ranks import run_distributed, torchrun
from zaya.errors import ZayaError
from zaya.infer.generate import Sampling, generate
from zaya.infer.tree import KERNELS, ShardedDecoder, generate_sharded
from zaya.parallel.comm import CommCounter

PROMPT = 7  # a multiple of neither 2 nor 3 ranks: the remainder goes through the decode step
SHORT = 2  # too short to shard (chunks under the convolutions' reach): every rank but the last starts empty
STEPS = 5
BATCH = 2
# tokens each rank's prefill keeps, by (ranks, prompt length): the largest multiple of the ranks, split evenly
CHUNK = {(1, PROMPT): PROMPT, (2, PROMPT): 3, (3, PROMPT): 2, (1, SHORT): SHORT, (2, SHORT): 0, (3, SHORT): 0}
EXACT = 1e-10


def _fp64_micro() -> zaya.Zaya:
    """micro, perturbed, in fp64 throughout (its router and LM head too: in fp32, their GEMMs would round
    differently for a chunk of the prompt than for the whole prompt, 1e-8 apart)."""
    return perturb(zaya.build_model(zaya.get_preset("micro", temp_init=1.0, fp32_logits=False), seed=0),
                   scale=0.5).eval().double()


def _fp32_micro() -> zaya.Zaya:
    # a large perturbation: greedy decoding of a near-initial model repeats one token
    return perturb(zaya.build_model(zaya.get_preset("micro", temp_init=1.0), seed=0), scale=1.0).eval()


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, 512, (BATCH, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _one_process(model: zaya.Zaya, ids: torch.Tensor, prompt_len: int):
    """Logits after the prompt and after each later token, one process, and its cache."""
    cache = model.new_cache()
    logits = [model(ids[:, :prompt_len], cache)[:, -1]]
    logits += [model(ids[:, t:t + 1], cache)[:, -1] for t in range(prompt_len, ids.shape[1])]
    return logits, cache


def _decode(model: zaya.Zaya, ids: torch.Tensor, prompt_len: int, kernel: str) -> dict:
    """Sharded decoding of ids (teacher-forced after the prompt) against one process: what the tests check."""
    reference, ref_cache = _one_process(model, ids, prompt_len)
    counter = CommCounter()
    decoder = ShardedDecoder(model, kernel=kernel, counter=counter)
    logits = [decoder.prefill(ids[:, :prompt_len])]
    states_after_prefill = [(c.conv_state is not None, c.value_state is not None) for c in decoder.cache.layers]
    counter.take()
    step_bytes = []
    for t in range(prompt_len, ids.shape[1]):
        logits.append(decoder.step(ids[:, t]))
        step_bytes.append(counter.take())
    state_diff = None
    if decoder.is_owner:
        state_diff = max(max((ours.conv_state - theirs.conv_state).abs().max().item(),
                             (ours.value_state - theirs.value_state).abs().max().item())
                         for ours, theirs in zip(decoder.cache.layers, ref_cache.layers, strict=True))
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(logits, reference, strict=True)),
        "finite": all(bool(torch.isfinite(x).all()) for x in logits),
        "states_after_prefill": states_after_prefill,
        "states_at_end": [(c.conv_state is not None, c.value_state is not None) for c in decoder.cache.layers],
        "state_diff": state_diff,
        "held": [c.length for c in decoder.cache.layers],
        "step_bytes": step_bytes,
    }


def _tokens(model: zaya.Zaya) -> dict:
    """generate_sharded against generate, fp32: greedy, seeded nucleus sampling and eos, both kernels."""
    prompt = _ids(PROMPT)
    sampled = Sampling(greedy=False, temperature=1.0, top_p=0.9, seed=3)
    greedy = generate(model, prompt, 10)
    eos = int(greedy[0, 4])
    cases = [("tree", "greedy", None, None), ("tree", "sampled", sampled, None), ("tree", "eos", None, eos),
             ("ring", "sampled", sampled, None)]
    out = {}
    for kernel, name, sampling, stop in cases:
        ours = generate_sharded(model, prompt, 10, sampling, kernel=kernel, eos_token_id=stop)
        theirs = greedy if name == "greedy" else generate(model, prompt, 10, sampling, eos_token_id=stop)
        out[(kernel, name)] = (ours.tolist(), theirs.tolist())
    return out


def _worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    model = _fp64_micro()
    report = {(kernel, n): _decode(model, _ids(n + STEPS), n, kernel) for kernel in KERNELS for n in (PROMPT, SHORT)}
    report["tokens"] = _tokens(_fp32_micro())
    return report


def _expected_step_bytes(kernel: str, rank: int, world: int, prompt_len: int, step: int) -> dict[str, int]:
    """What a rank sends for decode step `step` (0-based) of the micro model in fp64, by the formulas of
    `zaya.parallel.comm`: the query's broadcast (every rank but the last of the chain from the owner), then
    two all-reduces (2 S (p - 1) / p) for the tree, or every shard but the next rank's own for the ring."""
    config = zaya.get_preset("micro")
    layers, d = config.num_hidden_layers, config.head_dim
    Hq, Hk = config.num_attention_heads, config.num_key_value_heads
    owner = world - 1
    counts: dict[str, int] = {}
    if world > 1 and rank != (owner - 1) % world:
        counts["query"] = layers * BATCH * Hq * d * 8
    if kernel == "tree":
        counts["tree_max"] = layers * int(2 * BATCH * Hq * 8 * (world - 1) / world)
        counts["tree_sum"] = layers * int(2 * BATCH * Hq * (d + 1) * 8 * (world - 1) / world)
        return _sent(counts)
    chunk = CHUNK[(world, prompt_len)]
    held = [chunk] * world
    held[owner] += prompt_len - chunk * world + step + 1
    sent = sum(held[(rank - hop) % world] for hop in range(world - 1))
    counts["ring_kv"] = layers * sent * BATCH * Hk * d * 2 * 8
    return _sent(counts)


def _sent(counts: dict[str, int]) -> dict[str, int]:
    """The kinds of traffic that sent anything (a one-rank all-reduce is counted as 0 bytes)."""
    return {kind: n for kind, n in counts.items() if n}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_decoding_is_exact_and_keeps_the_states_on_the_last_rank(world):
    reports = run_distributed(_worker, world, timeout=150)
    for rank, report in enumerate(reports):
        owner = rank == world - 1
        for kernel in KERNELS:
            for prompt_len in (PROMPT, SHORT):
                got = report[(kernel, prompt_len)]
                where = f"{kernel}, prompt {prompt_len}, rank {rank} of {world}"
                assert got["finite"] and got["diff"] <= EXACT, (where, got["diff"])
                # the convolution and value-shift states: on the last rank, equal to one process's, and nowhere else
                assert got["states_at_end"] == [(owner, owner)] * 3, where
                if prompt_len == PROMPT:
                    assert got["states_after_prefill"] == [(owner, owner)] * 3, where
                if owner:
                    assert got["state_diff"] <= EXACT, where
                chunk = CHUNK[(world, prompt_len)]
                assert got["held"] == [prompt_len + STEPS - chunk * (world - 1) if owner else chunk] * 3, where
                for step, sent in enumerate(got["step_bytes"]):
                    assert _sent(sent) == _expected_step_bytes(kernel, rank, world, prompt_len, step), (where, step)
        for (kernel, name), (ours, theirs) in report["tokens"].items():
            assert ours == theirs, (kernel, name, rank)


# ---- one rank, in this process ---------------------------------------------------------------------------

@pytest.fixture
def one_rank():
    """A one-process gloo group (what `--shard-kv` makes without torchrun), gone afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_shard_decodes_as_one_process(one_rank):
    model = _fp64_micro()
    for kernel in KERNELS:
        for prompt_len in (PROMPT, 1):
            got = _decode(model, _ids(prompt_len + STEPS), prompt_len, kernel)
            assert got["diff"] <= EXACT and got["state_diff"] <= EXACT, (kernel, prompt_len)
            assert got["held"] == [prompt_len + STEPS] * 3
            assert all(_sent(sent) == {} for sent in got["step_bytes"])  # one rank sends nothing
    for (kernel, name), (ours, theirs) in _tokens(_fp32_micro()).items():
        assert ours == theirs, (kernel, name)


def test_bad_use_is_refused(one_rank):
    model = _fp32_micro()
    with pytest.raises(ZayaError, match="kernel must be one of tree, ring"):
        ShardedDecoder(model, kernel="allgather")
    decoder = ShardedDecoder(model)
    with pytest.raises(ZayaError, match="outside the model's vocabulary"):
        decoder.prefill(torch.tensor([[1, 512]]))
    with pytest.raises(ZayaError, match="empty"):
        decoder.prefill(torch.zeros(1, 0, dtype=torch.long))
    decoder.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ZayaError, match="already taken its prompt"):
        decoder.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ZayaError, match="max-new-tokens"):
        generate_sharded(model, torch.tensor([[1]]), -1)


def test_a_process_group_is_needed(make_model):
    assert not dist.is_initialized()
    with pytest.raises(ZayaError, match="process group"):
        ShardedDecoder(make_model("micro"))


# ---- the command line -------------------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    zaya.export_hf(_fp32_micro(), tmp_path / "hf")
    return tmp_path / "hf"


GENERATE = ("generate", "--prompt-ids", "5,17,3,9,11,2,8", "--max-new-tokens", "10", "--output", "ids",
            "--no-stop-at-eos")


def test_shard_kv_without_torchrun_is_one_shard(cli, hf_dir):
    code, plain, _ = cli(*GENERATE, "--model", hf_dir)
    assert code == 0 and len(plain.strip().split(",")) == 10
    for kernel in KERNELS:
        assert cli(*GENERATE, "--model", hf_dir, "--shard-kv", "--shard-kernel", kernel)[:2] == (0, plain)
    code, _, err = cli(*GENERATE, "--model", hf_dir, "--shard-kv", "--compile")
    assert code == 2 and err.strip() == "zaya: error: --compile does not apply to --shard-kv"


@pytest.mark.slow
def test_shard_kv_under_torchrun_prints_what_one_process_prints(cli, hf_dir):
    sampling = ("--temperature", "1.0", "--seed", "4")  # seeded draws: every rank must see the same logits
    code, expected, _ = cli(*GENERATE, "--model", hf_dir, *sampling)
    assert code == 0
    result = torchrun(*GENERATE, "--model", str(hf_dir), *sampling, "--shard-kv", nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout == expected  # rank 0 alone prints


@pytest.mark.slow
def test_a_bad_prompt_stops_every_rank_with_one_line(hf_dir):
    result = torchrun("generate", "--model", str(hf_dir), "--prompt-ids", "3,512", "--shard-kv", nproc=2, timeout=120)
    assert result.returncode != 0 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("zaya: error")]
    assert errors == ["zaya: error: prompt id 512 is outside the model's vocabulary (0..511)"], result.stderr[-3000:]
    exits = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+)", result.stderr))
    assert set(exits) == {"0", "1"} and "0" not in exits.values(), result.stderr[-3000:]
