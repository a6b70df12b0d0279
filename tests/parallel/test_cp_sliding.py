"""Sliding-window blocks under context parallelism (`zaya.parallel.cp_window`): the halo kernel where a window's
W - 1 keys before a chunk lie in the chunk before it, the all-gather and ring kernels with a windowed plan
where they do not. On 2 and 4 gloo ranks, fp64: the attention against a dense reference of the windowed
(document) mask, with the bytes it sends; the micro model with sliding and full blocks, split against one
device, with and without packed documents, and each document computed alone. Windows smaller than a chunk,
one more than a chunk (the halo is a whole chunk) and larger than one (the fallback)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_cp_documents import compiled_worker

import zaya
from modeling import dense_attention, perturb, random_attention_inputs
from ranks import run_distributed, summed_over_ranks
from zaya.model.documents import Documents, document_positions, packed_documents
from zaya.model.masks import DocumentLayout
from zaya.parallel.comm import CommCounter
from zaya.parallel.context import ContextParallel, SequenceLayout
from zaya.parallel.cp_attention import PairPlan
from zaya.parallel.cp_window import WindowPlan

T = 64
EOS = 1
# row 0: a one-token document, short ones packed together, [13, 30) and [30, 47) across the 16-token chunks'
# edges, [60, 64) cut by the row's end; row 1: [3, 17) starting just after an edge and crossing the next,
# [17, 63) longer than any window here, a one-token document at the very end
STARTS = ((0, 1, 6, 13, 14, 30, 47, 60), (0, 3, 17, 63))
EXACT = 1e-10


def _gather(tensor: torch.Tensor, layout: SequenceLayout, dim: int = 1) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(layout.ranks)]
    dist.all_gather(parts, tensor.contiguous())
    return layout.unshard(parts, dim=dim)


# ---- the plans (one process) -------------------------------------------------------------------------------

def _work_bound(window: int, batch: int) -> int:
    """The most pairs a sliding window's plan computes: each query over at most a tile of `masks._MIN_TILE` (64)
    or W queries and the W - 1 keys before it (MASKED tiles compute their whole rectangle)."""
    return batch * T_PLAN * (max(64, window) + window - 1)


T_PLAN = 1024  # the plans alone: chunks of 256 at cp = 2, head-tail


@pytest.mark.parametrize("starts", [None, ((0, 1, 6, 200, 255, 258, 700), (0, 700, 702))], ids=["causal", "documents"])
def test_the_halo_plan_computes_the_windowed_pairs_of_the_chunk_plans(starts):
    """The halo kernel's segments are those of the all-gather kernel's plan under the same window (whose pairs
    of chunks beyond the window are empty), and the work follows the window: every allowed pair, at most a tile
    and a window per query, growing with W, far below the causal mask's for a window well inside a chunk."""
    layout = SequenceLayout(T_PLAN, 2, "headtail")
    rows = starts or ((0,),) * 2
    first = torch.arange(T_PLAN)[None] - DocumentLayout(rows, T_PLAN).positions()
    causal = [PairPlan(layout, r, DocumentLayout(rows, T_PLAN), layout.shard(first, r), 2) for r in range(2)]
    totals = []
    for window in (1, 17, 100, 257):
        documents = DocumentLayout(rows, T_PLAN, window)
        halo = [WindowPlan(layout, r, documents, layout.shard(first, r), 2) for r in range(2)]
        pairs = [PairPlan(layout, r, documents, layout.shard(first, r), 2) for r in range(2)]
        assert [h.work for h in halo] == [p.work for p in pairs], window
        totals.append(sum(h.work for h in halo))
        assert documents.pairs() <= totals[-1] <= _work_bound(window, 2), (window, totals[-1])
        # beyond the window a pair of chunks computes nothing; with no window, every earlier chunk of a document
        assert sum(len(s) for p in pairs for s in p.sources) < sum(len(s) for p in causal for s in p.sources)
        if window == 1:  # each query sees itself only: no halo
            assert halo[0].halo_len == 0 and not halo[0].halo and not halo[1].halo
    assert totals == sorted(totals) and len(set(totals)) == len(totals), totals
    assert totals[1] < sum(p.work for p in causal) / 2, totals  # W = 17
    with pytest.raises(ValueError, match="does not fit"):
        WindowPlan(layout, 0, DocumentLayout(rows, T_PLAN, 258), layout.shard(first, 0), 2)


# ---- the attention against the dense mask (fp64, several processes) ------------------------------------------

def _attention_worker(rank: int, world: int, cases: list[tuple]) -> dict:
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    B, Hq, Hk, d = 2, 4, 2, 8
    q, k, v, grad_out = random_attention_inputs(B, Hq, Hk, T, d)
    results = {}
    for sharding, kernel, window, starts in cases:
        rows = starts or ((0,),) * B
        documents = DocumentLayout(rows, T)
        positions = documents.positions()
        first = torch.arange(T) - positions
        expected, qkv = dense_attention(q, k, v, grad_out, first, window)

        counter = CommCounter()
        base = ContextParallel(SequenceLayout(T, world, sharding), dist.group.WORLD, kernel, counter)
        split = base if starts is None else base.for_documents(documents, positions, window=window)
        local = [split.shard(x, dim=2).requires_grad_() for x in (q, k, v)]
        out = split.attention(*local, window)
        out.backward(split.shard(grad_out, dim=2))
        errors = {"out": (_gather(out.detach(), split.layout, 2) - expected).abs().max().item()}
        for name, ours, theirs in zip("qkv", local, qkv, strict=True):
            errors[f"grad_{name}"] = (_gather(ours.grad, split.layout, 2) - theirs.grad).abs().max().item()
        plan = split.attention_plan(B, torch.device("cpu"), window)
        # forward: a halo for each chunk whose successor is on another rank; backward: its gradient for each
        # chunk whose predecessor is
        layout, mine = split.layout, split.layout.chunks(rank)
        halo_bytes = B * (window - 1) * Hk * d * 2 * 8
        ahead = sum(1 for c in mine if c + 1 < layout.num_chunks and layout.owner(c + 1)[0] != rank)
        behind = sum(1 for c in mine if c > 0 and layout.owner(c - 1)[0] != rank)
        results[(sharding, kernel, window, starts is not None)] = {
            "errors": errors, "halo": isinstance(plan, WindowPlan), "work": split.attention_work,
            "planned": plan.work, "pairs": DocumentLayout(rows, T, window).pairs(), "sent": counter.take(),
            "halo_bytes": {"cp_window_kv": ahead * halo_bytes, "cp_window_dkv": behind * halo_bytes}}
    dist.destroy_process_group()
    return results


def _check_attention(results: list[dict], world: int) -> None:
    for rank, result in enumerate(results):
        for case, outcome in result.items():
            assert max(outcome["errors"].values()) <= EXACT, (rank, case, outcome["errors"])
            assert outcome["work"] == outcome["planned"] > 0, (rank, case, outcome)
            sharding, _, window, _ = case
            chunk = T // (2 * world if sharding == "headtail" else world)
            assert outcome["halo"] == (window - 1 <= chunk), (rank, case)
            sent = outcome["sent"]
            if outcome["halo"]:  # the halo and its gradient, exactly, and no block of keys
                assert sent == outcome["halo_bytes"], (rank, case, sent, outcome["halo_bytes"])
            else:
                assert sent["cp_kv"] > 0 and "cp_window_kv" not in sent, (rank, case, sent)
    for case in results[0]:  # over the ranks, every windowed pair, within the plan's bound
        total = sum(r[case]["work"] for r in results)
        pairs = results[0][case]["pairs"]
        assert pairs <= total <= _work_bound(case[2], 2) * T // T_PLAN, (case, total, pairs)


# head-tail: chunks of 16 (windows 6 and 17 take the halo, 24 and 40 fall back); contiguous: chunks of 32 (6, 24
# halo; 40 fallback)
ATTENTION_CASES = [(sharding, kernel, window, starts) for starts in (None, STARTS)
                   for sharding, kernel, window in (("headtail", "allgather", 6), ("headtail", "ring", 17),
                                                    ("headtail", "ring", 24), ("contiguous", "allgather", 24),
                                                    ("contiguous", "ring", 40))]


@pytest.mark.parametrize("isolate", [False, True], ids=["causal", "documents"])
def test_sliding_attention_equals_the_windowed_mask_across_two_ranks(isolate):
    cases = [case for case in ATTENTION_CASES if (case[3] is not None) == isolate]
    _check_attention(run_distributed(_attention_worker, 2, cases, timeout=60), 2)


def test_sliding_attention_equals_the_windowed_mask_across_four_ranks():
    cases = [("headtail", "allgather", 6, STARTS), ("headtail", "ring", 9, None), ("contiguous", "ring", 12, STARTS)]
    _check_attention(run_distributed(_attention_worker, 4, cases, timeout=60), 4)


def test_the_halo_sends_fewer_bytes_than_the_gathered_keys():
    """One layer's forward and backward at cp = 2, head-tail: the halo of a 6-token window against the all-gather
    kernel's traffic for the same split (a window of 40 falls back to it). Rank 0 holds chunks 0 and 3 of 16
    tokens, rank 1 chunks 1 and 2: one halo of 5 tokens of 2 rows, 2 KV heads of 8 fp64 values, keys and
    values, leaves each rank in forward and one gradient of it in backward."""
    results = run_distributed(_attention_worker, 2, [("headtail", "allgather", 6, None),
                                                     ("headtail", "allgather", 40, None)], timeout=60)
    halo, shard = 2 * 5 * 2 * 8 * 2 * 8, 2 * 32 * 2 * 8 * 2 * 8  # bytes: 5 tokens' keys and values, 32 tokens'
    for result in results:
        assert result[("headtail", "allgather", 6, False)]["sent"] == {"cp_window_kv": halo, "cp_window_dkv": halo}
        # gathered in forward and again in backward, and every rank's gradient of the other's keys returned
        assert result[("headtail", "allgather", 40, False)]["sent"] == {"cp_kv": 2 * shard, "cp_dkv": shard}


# ---- the micro model (fp64) ----------------------------------------------------------------------------------

def _rows(vocab: int) -> torch.Tensor:
    """Token ids [2, T + 1] whose inputs hold STARTS's documents, each ended by EOS (the last ones cut)."""
    ids = torch.randint(3, vocab, (len(STARTS), T + 1), generator=torch.Generator().manual_seed(11))
    for b, row in enumerate(STARTS):
        for start in row[1:]:
            ids[b, start - 1] = EOS
    return ids


def _model(window: int) -> torch.nn.Module:
    config = zaya.get_preset("micro", temp_init=1.0, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                             sliding_window=window)
    model = perturb(zaya.build_model(config, seed=0)).double()
    for i, block in enumerate(model.blocks):  # biases that make the zero padding at a document's start matter
        block.attn.conv0_bias.data.normal_(generator=torch.Generator().manual_seed(2 * i))
        block.attn.conv1_bias.data.normal_(generator=torch.Generator().manual_seed(2 * i + 1))
    return model


def _model_worker(rank: int, world: int, cases: list[tuple]) -> dict:
    """The hidden states and a random projection's gradient of every parameter, split against one device (both
    with or both without documents kept apart), and with documents against each document computed alone."""
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    results = {}
    for sharding, kernel, window, isolate in cases:
        model = _model(window)
        ids = _rows(model.config.vocab_size)
        inputs = ids[:, :-1]
        projection = torch.randn(len(STARTS), T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
        documents = packed_documents(inputs, EOS, window=model.config.active_window) if isolate else None
        full_hidden = model.hidden_states(inputs, documents=documents)
        (full_hidden * projection).sum().backward()
        reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()

        split = ContextParallel(SequenceLayout(T, world, sharding), dist.group.WORLD, kernel)
        where = {}
        if isolate:
            positions = document_positions(inputs, EOS)
            split = split.for_documents(DocumentLayout.from_tokens(inputs, EOS), positions,
                                        window=model.config.active_window)
            where["documents"] = Documents(split.shard(positions), None)
        hidden = model.hidden_states(split.shard(inputs), sequence=split, positions=split.positions(), **where)
        part = (hidden * split.shard(projection)).sum()
        part.backward()
        _, summed = summed_over_ranks(part, model)
        hidden = _gather(hidden.detach(), split.layout)
        outcome = {"hidden": (hidden - full_hidden.detach()).abs().max().item(),
                   "grads": max((summed[n] - g).abs().max().item() for n, g in reference.items()),
                   "missing": set(reference) - set(summed), "kernels": sorted({type(split.attention_plan(
                       2, torch.device("cpu"), w)).__name__ for w in (None, window)})}
        if isolate:
            with torch.no_grad():
                outcome["alone"] = max(
                    (hidden[b, s:e] - model.hidden_states(inputs[b:b + 1, s:e])[0]).abs().max().item()
                    for b, row in enumerate(STARTS) for s, e in zip(row, (*row[1:], T), strict=True))
        results[(sharding, kernel, window, isolate)] = outcome
    dist.destroy_process_group()
    return results


def _check_model(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for case, outcome in result.items():
            assert not outcome["missing"], (rank, case, outcome["missing"])
            worst = max(outcome["hidden"], outcome["grads"], outcome.get("alone", 0.0))
            assert worst <= EXACT, (rank, case, outcome)


@pytest.mark.parametrize("isolate", [False, True], ids=["causal", "documents"])
def test_the_model_with_sliding_blocks_split_over_two_ranks_equals_one_device(isolate):
    """Head-tail chunks of 16, contiguous of 32: windows of 6 (halo), 24 (head-tail falls back, contiguous
    takes the halo) and 40 (both fall back)."""
    cases = [("headtail", "ring", 6, isolate), ("headtail", "allgather", 24, isolate),
             ("contiguous", "allgather", 24, isolate), ("contiguous", "ring", 40, isolate)]
    results = run_distributed(_model_worker, 2, cases, timeout=60)
    _check_model(results)
    kernels = {case[:3]: outcome["kernels"] for case, outcome in results[0].items()}
    assert kernels[("headtail", "ring", 6)] == kernels[("contiguous", "allgather", 24)] == ["PairPlan", "WindowPlan"]
    assert kernels[("headtail", "allgather", 24)] == kernels[("contiguous", "ring", 40)] == ["PairPlan"]


def test_the_model_with_sliding_blocks_and_documents_split_over_four_ranks_equals_one_device():
    """Head-tail chunks of 8: a window of 6 takes the halo, 12 falls back."""
    _check_model(run_distributed(_model_worker, 4, [("headtail", "allgather", 6, True),
                                                    ("headtail", "ring", 12, True)], timeout=60))


# ---- compiled ------------------------------------------------------------------------------------------------

def test_a_compiled_sliding_layer_takes_every_micro_batch_without_compiling_again():
    """The halo kernel and its plan run eagerly inside the compiled layer: a new split each micro-batch compiles
    nothing new."""
    for frames in run_distributed(compiled_worker, 2, "allgather", 6, 2, timeout=60):
        assert frames[0] > 0 and frames[-1] == frames[0], frames
