"""Context-parallel chunks dealt out by the attention work of packed documents (`zaya.parallel.document_balance`,
`SequenceLayout.balanced`): the work of a chunk against the plan's segments, valid and deterministic layouts that
balance what head-tail does not (and keep what it does), the split checks, and on 4 gloo ranks the micro model's
loss and every parameter gradient with a balanced layout equal to those with head-tail's, while the work the
attention measured per rank evens out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zaya
from modeling import perturb
from ranks import run_distributed, summed_over_ranks
from zaya.errors import ZayaError
from zaya.model.documents import Documents, document_positions
from zaya.model.masks import DocumentLayout, segment_work
from zaya.parallel.config import ParallelConfig, sequence_split_problem
from zaya.parallel.context import ContextParallel, SequenceLayout
from zaya.parallel.document_balance import chunk_work, deal, greedy, imbalance, rank_work, swap

T = 128
EOS = 1
# short documents, then a long one to the row's end (cut there): over [48, 128) and [60, 128), chunks 3-7 of
# head-tail at cp = 4, so that the rank holding chunk 7 does far more work than the others
SKEWED = ((0, 6, 13, 21, 26, 35, 41, 48), (0, 1, 9, 17, 30, 38, 44, 60))


def _headtail(ranks: int, length: int = T) -> tuple[tuple[int, ...], ...]:
    return tuple(SequenceLayout(length, ranks).chunks(r) for r in range(ranks))


def _random_starts(rng: np.random.Generator, length: int, mean: float, step: int = 1) -> tuple[int, ...]:
    """Document starts of a row of `length` tokens, lognormal lengths of about `mean` (multiples of `step`)."""
    lengths = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, length).astype(np.int64)) * step
    starts = np.concatenate(([0], np.cumsum(lengths)))
    return tuple(int(s) for s in starts[starts < length])


# ---- the work of a chunk (one process) -------------------------------------------------------------------

def test_the_work_of_a_chunk_is_what_the_plan_computes_for_it():
    """Against the segments of the chunk against itself and every earlier chunk, as `segment_work` counts them;
    document starts and chunk edges on multiples of 16 tokens, so that no piece of a document is short enough to
    be packed with its neighbours into a larger rectangle."""
    rng = np.random.default_rng(0)
    documents = DocumentLayout((_random_starts(rng, 1024, 5, step=16), _random_starts(rng, 1024, 3, step=16), (0,)),
                               1024)
    for chunks in (4, 16, 64):
        L = 1024 // chunks
        planned = [sum(segment_work(documents.segments((cq * L, cq * L + L), (ck * L, ck * L + L)), 3)
                       for ck in range(cq + 1)) for cq in range(chunks)]
        assert chunk_work(documents, chunks).tolist() == planned


def test_the_work_of_the_chunks_adds_up_to_the_pairs_the_mask_allows():
    """Whatever the documents (one token long, crossing any number of chunks) and however many chunks: the total
    is every allowed (query, key) pair once."""
    rng = np.random.default_rng(1)
    for mean in (2, 40, 300):
        documents = DocumentLayout(tuple(_random_starts(rng, 960, mean) for _ in range(3)), 960)
        for chunks in (1, 6, 32, 960):
            assert int(chunk_work(documents, chunks).sum()) == documents.pairs()


def test_one_document_per_row_is_the_causal_mask():
    work = chunk_work(DocumentLayout(((0,),) * 2, 64), 8)
    assert work.tolist() == [2 * (36 + 64 * c) for c in range(8)]  # a triangle of 8, and 8 x 8 per earlier chunk


# ---- the layout (one process) ----------------------------------------------------------------------------

@pytest.mark.parametrize(("ranks", "per_rank"), [(2, 4), (4, 2), (4, 8), (3, 5)])
def test_a_balanced_layout_holds_every_chunk_once_and_reassembles(ranks, per_rank):
    length = 480
    rng = np.random.default_rng(ranks * 10 + per_rank)
    documents = DocumentLayout((_random_starts(rng, length, 30), _random_starts(rng, length, 100)), length)
    layout = SequenceLayout.balanced(length, ranks, documents, per_rank)
    assert layout.check(min_chunk=2) is None
    assert layout.num_chunks == ranks * per_rank and layout.chunk_len == length // (ranks * per_rank)
    held = [layout.chunks(r) for r in range(ranks)]
    assert all(len(c) == per_rank and list(c) == sorted(c) for c in held)
    assert sorted(c for chunks in held for c in chunks) == list(range(ranks * per_rank))
    for chunk in range(layout.num_chunks):
        rank, slot = layout.owner(chunk)
        assert layout.chunks(rank)[slot] == chunk
    x = torch.arange(3 * length).view(3, length)
    shards = [layout.shard(x, r) for r in range(ranks)]
    assert all(torch.equal(s, x[:, layout.positions(r)]) for r, s in enumerate(shards))
    assert torch.equal(layout.unshard(shards), x)
    assert torch.equal(layout.unshard([layout.shard(x.T, r, dim=0) for r in range(ranks)], dim=0), x.T)


def test_balance_beats_head_tail_where_documents_skew_the_work():
    documents = DocumentLayout(SKEWED, T)
    headtail = imbalance(rank_work(chunk_work(documents, 8), _headtail(4)))
    layout = SequenceLayout.balanced(T, 4, documents, 4)
    balanced = imbalance(rank_work(chunk_work(documents, 16), layout.assignment))
    assert headtail > 1.3 and balanced < 1.05, (headtail, balanced)


@pytest.mark.parametrize(("ranks", "per_rank"), [(2, 2), (2, 8), (4, 4), (8, 8), (8, 16)])
def test_one_document_per_row_keeps_head_tails_exact_balance(ranks, per_rank):
    """The causal mask without packing: head-tail is exact, and so is the deal."""
    length = 2048
    documents = DocumentLayout(((0,),) * 3, length)
    assert imbalance(rank_work(chunk_work(documents, 2 * ranks), _headtail(ranks, length))) == 1.0
    layout = SequenceLayout.balanced(length, ranks, documents, per_rank)
    assert imbalance(rank_work(chunk_work(documents, ranks * per_rank), layout.assignment)) == 1.0


def test_the_layout_depends_on_the_documents_only():
    """The same documents give the same layout (every rank plans its own); equal work goes by index."""
    rng = np.random.default_rng(3)
    rows = tuple(_random_starts(rng, 4096, 200) for _ in range(2))
    first = SequenceLayout.balanced(4096, 8, DocumentLayout(rows, 4096), 8)
    again = SequenceLayout.balanced(4096, 8, DocumentLayout(tuple(tuple(r) for r in rows), 4096), 8)
    assert first == again and hash(first) == hash(again)
    # documents exactly one chunk long: every chunk the same work, dealt out round and round in index order
    tied = SequenceLayout.balanced(96, 3, DocumentLayout((tuple(range(0, 96, 16)),), 96), 2)
    assert tied.assignment == ((0, 3), (1, 4), (2, 5))


def test_swaps_mend_what_the_greedy_deal_cannot():
    """Greedy, largest first: {9, 4, 3} and {5, 4, 3} (16 against 12), since the last chunk must go to the one
    rank still short of one; a swap of a 4 for a 3 gives 15 and 13, the best there is."""
    work = [9, 5, 4, 4, 3, 3]
    assert rank_work(np.array(work), greedy(work, 2)).tolist() == [16, 12]
    assert rank_work(np.array(work), deal(work, 2)).tolist() == [15, 13]
    assert sorted(rank_work(np.array(work), swap(work, ((0, 1, 2), (3, 4, 5))))) == [13, 15]  # swaps alone too


def test_planning_a_long_micro_batch_is_quick():
    """131,072 tokens of four rows, 8 ranks x 8 chunks each: the planner runs once per micro-batch on every
    rank, on the host (a few tenths of a millisecond; the bound leaves room for a loaded machine)."""
    import time

    rng = np.random.default_rng(4)
    documents = DocumentLayout(tuple(_random_starts(rng, 131072, 512) for _ in range(4)), 131072)
    SequenceLayout.balanced(131072, 8, documents, 8)
    started = time.perf_counter()
    for _ in range(5):
        SequenceLayout.balanced(131072, 8, documents, 8)
    assert (time.perf_counter() - started) / 5 < 0.05


# ---- checks ----------------------------------------------------------------------------------------------

def test_a_split_that_does_not_fit_says_why():
    assert sequence_split_problem(120, 4, "headtail", chunks_per_rank=8) == (
        "a sequence of 120 tokens does not split into cp x parallel.cp_document_chunks = 4 x 8 = 32 chunks of "
        "equal length")
    assert "shorter than the 3 tokens" in sequence_split_problem(128, 4, "headtail", 3, chunks_per_rank=16)
    assert sequence_split_problem(128, 4, "headtail", 2, chunks_per_rank=16) is None
    assert sequence_split_problem(120, 4, "contiguous", chunks_per_rank=8) is None  # never balanced
    with pytest.raises(ZayaError, match=r"does not split into cp x parallel.cp_document_chunks = 4 x 8"):
        SequenceLayout.balanced(120, 4, DocumentLayout(((0,),), 120), 8)
    with pytest.raises(ZayaError, match="rows of 64 tokens for a sequence of 128"):
        SequenceLayout.balanced(128, 4, DocumentLayout(((0,),), 64), 4)


@pytest.mark.parametrize(("assignment", "words"), [
    (((0, 1), (2,)), "the same number of chunks"),
    (((0, 1), (2, 3), (4, 5)), "the same number of chunks"),
    (((1, 0), (2, 3)), "ascending"),
    (((0, 1), (1, 3)), "each of the chunks 0 .. 3 once"),
    (((0, 1), (2, 4)), "each of the chunks 0 .. 3 once"),
])
def test_an_assignment_that_is_no_layout_says_why(assignment, words):
    assert words in SequenceLayout(64, 2, assignment=assignment).check()


def test_the_chunks_per_rank_key_is_checked():
    ParallelConfig(cp_document_chunks=2).validate("run.toml")
    with pytest.raises(ZayaError, match=r"run.toml: key 'parallel.cp_document_chunks' must be at least 2 .*got 1"):
        ParallelConfig(cp_document_chunks=1).validate("run.toml")


# ---- the model on 2 ranks: balanced against head-tail ---------------------------------------------------

def _balanced_worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    # fp64, the LM head included: only the order of sums differs between the layouts, and the loss's fp32 softmax
    model = perturb(zaya.build_model(zaya.get_preset("micro", temp_init=1.0, fp32_logits=False), seed=0)).double()
    ids = torch.randint(3, model.config.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(5))
    for b, row in enumerate(SKEWED):
        for start in row[1:]:
            ids[b, start - 1] = EOS
    inputs, targets = ids[:, :-1], ids[:, 1:]
    documents = DocumentLayout.from_tokens(inputs, EOS)
    assert documents.starts == SKEWED
    positions = document_positions(inputs, EOS)
    out = {}
    for chunks in (2, 4, 8):  # 2: head-tail's pairs; 4, 8: dealt out by work
        model.zero_grad()
        base = ContextParallel(SequenceLayout(T, world), dist.group.WORLD, "allgather")
        split = base.for_documents(documents, positions, chunks_per_rank=chunks)
        local_targets = split.shard(targets)
        part = model.loss(split.shard(inputs), local_targets, sequence=split, positions=split.positions(),
                          documents=Documents(split.shard(positions), None)) * (local_targets.numel() / targets.numel())
        work = base.attention_work  # the forward's pairs, before the backward adds its own
        part.backward()
        loss, grads = summed_over_ranks(part, model)
        out[chunks] = {"loss": loss.item(), "grads": grads, "work": work, "chunks": split.layout.chunks(rank)}
    dist.destroy_process_group()
    return out


def test_the_model_with_a_balanced_layout_equals_head_tail_and_evens_out_the_work():
    """With 4 and 8 chunks per rank, the loss and every parameter gradient within 1e-6 (relative; the largest
    entry's, for a gradient) of head-tail's: an fp64 model, whose loss's softmax is fp32 all the same (3e-8 seen).
    On rows whose documents leave head-tail's busiest rank with a third more work than the other, the pairs the
    attention computed per rank (its own count) even out."""
    results = run_distributed(_balanced_worker, 2, timeout=120)
    reference = results[0][2]
    for rank, result in enumerate(results):
        for chunks in (4, 8):
            outcome = result[chunks]
            assert len(outcome["chunks"]) == chunks
            assert abs(outcome["loss"] - reference["loss"]) <= 1e-6 * abs(reference["loss"]), (rank, chunks)
            assert outcome["grads"].keys() == reference["grads"].keys()
            worst = max(((grad - reference["grads"][name]).abs().max() / reference["grads"][name].abs().max()).item()
                        for name, grad in outcome["grads"].items())
            assert worst <= 1e-6, (rank, chunks, worst)
    work = {chunks: np.array([r[chunks]["work"] for r in results]) for chunks in (2, 4, 8)}
    assert imbalance(work[2]) > 1.25, work[2]
    assert imbalance(work[4]) < 1.05 and imbalance(work[8]) < 1.05, work
