import concurrent.futures
import json
import threading

import pytest
import torch

from zaya.data import loader as loader_module
from zaya.data.loader import TokenLoader
from zaya.data.ramp import BatchRamp
from zaya.data.split_tokens import SplitTokens
from zaya.errors import ZayaError

SEQ = 16
RAMP = BatchRamp(start=6, increment=6, final=24, ramp_samples=120)


@pytest.fixture
def dataset(position_dataset):
    # 40,001 tokens: 2,500 windows of 17 tokens; shards of 7,000 tokens so windows cross shard files
    return position_dataset("positions", 40_001, val_tokens=1_001, shard_tokens=7_000)


def _loader(path, **kwargs):
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("group_blocks", 4)
    return TokenLoader([(path, 1.0)], seq_len=SEQ, seed=7, **kwargs)


def _run(loader: TokenLoader, steps: int) -> list[torch.Tensor]:
    return [loader.next_batch(RAMP.at(loader.consumed_samples)) for _ in range(steps)]


def _starts(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


def test_samples_are_windows_of_the_token_stream(dataset):
    with _loader(dataset) as loader:
        batch = loader.next_batch(24)
    assert batch.shape == (24, SEQ + 1) and batch.dtype == torch.int64
    for row in batch:
        assert row[0] % SEQ == 0
        assert torch.equal(row, torch.arange(row[0], row[0] + SEQ + 1))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_together_see_the_single_process_batch_in_order(dataset, world_size):
    with _loader(dataset) as single:
        reference = _run(single, 30)
        assert single.consumed_samples > 120  # past the end of the ramp
    ranks = [_loader(dataset, rank=r, world_size=world_size) for r in range(world_size)]
    for step, expected in enumerate(reference):
        size = RAMP.at(ranks[0].consumed_samples)
        parts = [loader.next_batch(size) for loader in ranks]
        assert all(p.shape[0] == size // world_size for p in parts)
        assert torch.equal(torch.cat(parts), expected), step
    for loader in ranks:
        loader.close()


@pytest.mark.parametrize(("before", "after"), [(1, 3), (3, 2), (2, 1)])
def test_resume_mid_ramp_with_another_world_size(dataset, before, after):
    with _loader(dataset) as single:
        reference = _run(single, 25)
    first = [_loader(dataset, rank=r, world_size=before) for r in range(before)]
    for step in range(7):  # 7 steps: mid-ramp, and mid-epoch (2,500 samples per epoch)
        size = RAMP.at(first[0].consumed_samples)
        assert torch.equal(torch.cat([loader.next_batch(size) for loader in first]), reference[step])
    saved = json.loads(json.dumps(first[0].state_dict()))
    assert all(loader.state_dict() == saved for loader in first)
    assert RAMP.at(saved["consumed_samples"]) < RAMP.final
    for loader in first:
        loader.close()
    resumed = [_loader(dataset, rank=r, world_size=after) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(saved)
    for step in range(7, 25):
        size = RAMP.at(resumed[0].consumed_samples)
        assert torch.equal(torch.cat([loader.next_batch(size) for loader in resumed]), reference[step]), step
    for loader in resumed:
        loader.close()


def test_resume_across_an_epoch_boundary(dataset):
    with _loader(dataset) as loader:
        for _ in range(110):
            loader.next_batch(24)  # 2,640 samples: into the second epoch
        state = loader.state_dict()
        expected = loader.next_batch(24)
    with _loader(dataset, consumed_samples=state["consumed_samples"]) as resumed:
        assert torch.equal(resumed.next_batch(24), expected)


@pytest.mark.parametrize("chunk_tokens", [1, 3 * 12 * (SEQ + 1), 1 << 20])
def test_reading_ahead_in_chunks_does_not_change_batches(dataset, monkeypatch, chunk_tokens):
    sizes = [6, 6, 12, 12, 12, 12, 12, 6, 24, 24, 24]
    with _loader(dataset, prefetch=0) as plain:
        expected = [plain.next_batch(size) for size in sizes]
    monkeypatch.setattr(loader_module, "_CHUNK_TOKENS", chunk_tokens)
    with _loader(dataset, prefetch=3, skip_ranges=[(500, 510)]) as ahead, _loader(
        dataset, prefetch=0, skip_ranges=[(500, 510)]
    ) as plain_skipping:
        for size, batch in zip(sizes, expected, strict=True):
            assert torch.equal(ahead.next_batch(size), batch)
            plain_skipping.next_batch(size)
            assert ahead.consumed_samples == plain_skipping.consumed_samples


def test_skipped_samples_never_appear_and_the_rest_keep_their_place(dataset):
    with _loader(dataset) as plain:
        stream = torch.cat([plain.next_batch(12) for _ in range(20)])  # positions 0..239
    skips = [(5, 9), (30, 31), (100, 150)]
    with _loader(dataset, skip_ranges=skips) as skipping:
        got = torch.cat([skipping.next_batch(12) for _ in range(15)])
        assert skipping.consumed_samples == 180 + 55
    kept = [p for p in range(240) if not any(a <= p < b for a, b in skips)][:180]
    assert torch.equal(got, stream[kept])


def test_adding_a_skip_range_mid_run(dataset):
    with _loader(dataset) as plain:
        stream = torch.cat([plain.next_batch(6) for _ in range(10)])
    with _loader(dataset, prefetch=3) as loader:
        first = loader.next_batch(6)
        loader.add_skip_range(8, 20)  # batches 8..19 were already being read ahead
        rest = torch.cat([loader.next_batch(6) for _ in range(7)])
    assert torch.equal(first, stream[:6])
    assert torch.equal(rest, torch.cat([stream[6:8], stream[20:60]]))


def test_mixture_draws_by_weight(position_dataset):
    a = position_dataset("a", 20_001)
    b = position_dataset("b", 20_001, offset=10_000_000)
    with TokenLoader([(a, 3.0), (b, 1.0)], seq_len=SEQ, seed=1, block_size=8, group_blocks=8) as loader:
        firsts = torch.cat([loader.next_batch(64)[:, 0] for _ in range(10)])
    from_b = int((firsts >= 10_000_000).sum())
    assert from_b == 160  # exactly a quarter: 640 samples in whole groups of 8 blocks


def test_mixture_needs_one_tokenizer(position_dataset):
    a = position_dataset("a", 2_001, tokenizer_json=b'{"a": 1}')
    b = position_dataset("b", 2_001, tokenizer_json=b'{"b": 2}')
    with pytest.raises(ZayaError, match="different tokenizer"):
        TokenLoader([(a, 1.0), (b, 1.0)], seq_len=SEQ, seed=0)


def test_state_must_match_the_loader(dataset):
    with _loader(dataset) as loader:
        loader.next_batch(6)
        state = loader.state_dict()
    with TokenLoader([(dataset, 1.0)], seq_len=SEQ, seed=8, block_size=8, group_blocks=4) as other:
        with pytest.raises(ZayaError, match="'seed' is 7, but this loader has 8"):
            other.load_state_dict(state)
        with pytest.raises(ZayaError, match="consumed_samples must be a non-negative integer"):
            other.load_state_dict({**state, "seed": 8, "consumed_samples": -3})


def test_bad_batch_sizes_and_too_little_data(dataset, position_dataset):
    with _loader(dataset, world_size=4, rank=1) as loader, pytest.raises(
        ZayaError, match="global batch size 6 is not divisible by the world size 4"
    ):
        loader.next_batch(6)
    tiny = position_dataset("tiny", 10)
    with pytest.raises(ZayaError, match="fewer than one sample of seq_len"):
        TokenLoader([(tiny, 1.0)], seq_len=SEQ, seed=0)
    with pytest.raises(ZayaError, match="rank 2 is not in"):
        TokenLoader([(dataset, 1.0)], seq_len=SEQ, seed=0, rank=2, world_size=2)


def test_eval_batches_are_fixed_and_split_over_ranks(dataset):
    with _loader(dataset) as loader:
        loader.next_batch(24)
        first = list(loader.iter_eval_batches(12))
        second = list(loader.iter_eval_batches(12, max_batches=2))
    assert len(first) == 5  # 62 windows of the val split in batches of 12
    assert all(torch.equal(a, b) for a, b in zip(first[:2], second, strict=True))
    starts = torch.cat(first)[:, 0]
    assert torch.equal(starts, torch.arange(0, 60 * SEQ, SEQ))
    halves = [list(_loader(dataset, rank=r, world_size=2).iter_eval_batches(12)) for r in range(2)]
    for b, batch in enumerate(first):
        assert torch.equal(torch.cat([halves[0][b], halves[1][b]]), batch)
    with _loader(dataset) as loader, pytest.raises(ZayaError, match="fewer than one eval batch"):
        next(loader.iter_eval_batches(64))


def test_vocab_check(position_dataset):
    path = position_dataset("small", 5_001, vocab_size=8192)
    with TokenLoader([(path, 1.0)], seq_len=SEQ, seed=0) as loader:
        loader.check_vocab(16_384)  # a smaller tokenizer than the model's vocabulary is fine
        loader.check_vocab(5_001)
        with pytest.raises(ZayaError, match="token id 5000 does not fit the model's vocabulary of 4096"):
            loader.check_vocab(4096)


def test_blocks_are_prefetched_in_the_background(dataset, monkeypatch):
    monkeypatch.setattr(loader_module, "_CHUNK_TOKENS", 2 * 6 * (SEQ + 1))  # two batches of 6 per chunk
    advised = []  # (thread, ranges)
    advise = SplitTokens.advise

    def spying_advise(self, ranges):
        ranges = list(ranges)
        advised.append((threading.current_thread().name, ranges))
        advise(self, ranges)

    monkeypatch.setattr(SplitTokens, "advise", spying_advise)
    with _loader(dataset, prefetch=2) as loader:
        for _ in range(3):
            loader.next_batch(6)
        concurrent.futures.wait([chunk.advice for chunk in loader._pending if chunk.advice is not None])
        # chunk 0 (batches 0-1) is used up; chunks 1-3 (batches 2-7) are planned and their blocks advised
        assert 1 <= len(advised) <= 4
        assert all(thread.startswith("zaya-data") for thread, _ in advised)
        upcoming = torch.cat([loader.next_batch(6) for _ in range(5)])
    ranges = [r for _, rs in advised for r in rs]
    for row in upcoming:
        start = int(row[0])
        assert any(a <= start and start + SEQ + 1 <= b for a, b in ranges)
    # whole blocks of 8 samples, as the order reads them
    assert all(b - a in (8 * SEQ + 1, 40_001 - a) for a, b in ranges)
