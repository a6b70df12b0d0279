"""Packed documents kept apart under context parallelism (`ContextParallel.for_documents`): on 2 and 4 gloo ranks,
both kernels and both shardings (and the balanced layout), the attention against a dense reference of the document
mask, and the micro model's loss, hidden states and every parameter gradient against one device with the same
documents kept apart and against each document computed alone. The rows mix one-token documents, runs of short
ones, documents longer than a chunk that cross chunk and rank boundaries, documents that start one or two tokens
before a chunk (the convolutions' halo is then cut inside it) and a row that ends mid-document."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zaya
from modeling import dense_attention, perturb, random_attention_inputs
from ranks import run_distributed, summed_over_ranks
from zaya.errors import ZayaError
from zaya.model.documents import Documents, document_positions, packed_documents
from zaya.model.masks import DocumentLayout, segment_work
from zaya.parallel.context import ContextParallel, SequenceLayout
from zaya.parallel.cp_attention import PairPlan

T = 128
EOS = 1
# row 0: one-token documents (0, 29, 64, 101), short ones packed together, [62, 64) ending on a chunk edge, [30, 47)
# and [65, 101) across chunk edges, [115, 128) cut by the row's end; row 1: [3, 100) longer than any rank's share,
# [14, ...) two tokens before an edge of 16-token chunks, a one-token document at the very end
STARTS = ((0, 1, 6, 29, 30, 47, 62, 64, 65, 101, 102, 115), (0, 3, 14, 100, 127))
LAYOUTS = [(sharding, kernel) for sharding in ("headtail", "contiguous") for kernel in ("allgather", "ring")]


def _gather(tensor: torch.Tensor, layout: SequenceLayout, dim: int = 1) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(layout.ranks)]
    dist.all_gather(parts, tensor.contiguous())
    return layout.unshard(parts, dim=dim)


def _predicted_work(layout: SequenceLayout, rank: int, documents: DocumentLayout) -> int:
    """The query-key pairs of every segment of this rank's chunks against every chunk before or at them."""
    L, B = layout.chunk_len, documents.batch
    return sum(segment_work(documents.segments((cq * L, (cq + 1) * L), (ck * L, (ck + 1) * L)), B)
               for cq in layout.chunks(rank) for ck in range(cq + 1))


# ---- the plan (one process) -----------------------------------------------------------------------------

def test_a_pair_of_chunks_that_shares_no_document_is_not_planned():
    layout = SequenceLayout(64, 2, "headtail")  # chunks of 16: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    documents = DocumentLayout(((0, 16, 32, 48),), 64)  # a document per chunk
    first = torch.arange(64)[None] - documents.positions()
    plans = [PairPlan(layout, rank, documents, layout.shard(first, rank), 1) for rank in range(2)]
    # each chunk only against itself: rank 0 computes its two squares with its own keys, nothing with rank 1's
    assert [len(p) for p in plans[0].sources] == [2, 0]
    assert [len(p) for p in plans[1].sources] == [0, 2]
    assert plans[0].work == plans[1].work == 2 * 16 * 17 // 2
    # one document per row: the causal mask, every earlier chunk in full
    causal = DocumentLayout(((0,),), 64)
    zeros = torch.zeros(1, 32, dtype=torch.long)
    assert sum(PairPlan(layout, r, causal, zeros, 1).work for r in range(2)) == 64 * 65 // 2


# ---- attention against the dense mask (fp64) ---------------------------------------------------------------

def _attention_worker(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    B, Hq, Hk, d = 2, 4, 2, 16
    q, k, v, grad_out = random_attention_inputs(B, Hq, Hk, T, d)
    cases = [(sharding, kernel, window, STARTS, 2) for sharding, kernel in LAYOUTS for window in (None, 20)]
    cases += [("headtail", "ring", None, (STARTS[1], STARTS[1]), 2),  # every row the same documents
              ("headtail", "allgather", 20, STARTS, 4), ("headtail", "ring", None, STARTS, 4)]  # balanced
    results = {}
    for sharding, kernel, window, starts, chunks in cases:
        documents = DocumentLayout(starts, T, window)
        positions = documents.positions()
        first = torch.arange(T) - positions
        expected, qkv = dense_attention(q, k, v, grad_out, first, window)

        base = ContextParallel(SequenceLayout(T, world, sharding), dist.group.WORLD, kernel)
        split = base.for_documents(documents, positions, chunks_per_rank=chunks)
        local = [split.shard(x, dim=2).requires_grad_() for x in (q, k, v)]
        out = split.attention(*local)
        out.backward(split.shard(grad_out, dim=2))
        errors = {"out": (_gather(out.detach(), split.layout, 2) - expected).abs().max().item()}
        for name, ours, theirs in zip("qkv", local, qkv, strict=True):
            errors[f"grad_{name}"] = (_gather(ours.grad, split.layout, 2) - theirs.grad).abs().max().item()
        results[(sharding, kernel, window, len(set(starts)), chunks)] = {
            "errors": errors, "pairs": documents.pairs(), "work": (split.attention_work, base.attention_work),
            "predicted": _predicted_work(split.layout, rank, documents), "chunks": split.layout.chunks(rank)}
    # the split without the documents (the causal mask) lets them see each other: the checks have teeth
    plain = ContextParallel(SequenceLayout(T, world), dist.group.WORLD)
    out = plain.attention(*(plain.shard(x, dim=2) for x in (q, k, v)))
    results["plain"] = (_gather(out, plain.layout, 2) - expected.detach()).abs().max().item()
    # refusals, one line each
    base = ContextParallel(SequenceLayout(T, world), dist.group.WORLD)
    documents = DocumentLayout(STARTS, T)
    refusals = []
    for call in (lambda: base.for_documents(DocumentLayout(STARTS, 2 * T), torch.zeros(2, 2 * T)),
                 lambda: base.for_documents(documents, torch.zeros(3, T)),
                 lambda: base.for_documents(documents, documents.positions(), chunks_per_rank=0),
                 lambda: base.for_documents(documents, documents.positions()).attention_plan(3, torch.device("cpu"))):
        try:
            call()
            refusals.append(None)
        except ZayaError as error:
            refusals.append(str(error))
    dist.destroy_process_group()
    return {"cases": results, "refusals": refusals}


@pytest.mark.parametrize("world", [2, 4])
def test_attention_keeps_documents_apart_across_ranks(world):
    results = run_distributed(_attention_worker, world, timeout=120)
    for rank, result in enumerate(results):
        assert result["cases"].pop("plain") > 0.1
        for case, outcome in result["cases"].items():
            assert max(outcome["errors"].values()) <= 1e-10, (rank, case, outcome["errors"])
            # what the kernels computed is what the plan says, counted in the object it was split from too
            own, base = outcome["work"]
            assert own == base == outcome["predicted"] > 0, (rank, case, outcome["work"], outcome["predicted"])
            sharding, _, _, _, chunks = case
            assert len(outcome["chunks"]) == (chunks if sharding == "headtail" else 1)
        assert all(r is not None and "\n" not in r for r in result["refusals"]), result["refusals"]
    for case, outcome in results[0]["cases"].items():
        # over the ranks, every pair the mask allows and little more (packs of short documents compute their
        # whole square, window bands their tiles): far from the causal mask's B T (T + 1) / 2
        total = sum(r["cases"][case]["predicted"] for r in results)
        assert outcome["pairs"] <= total < 2 * T * (T + 1) // 2, (case, total, outcome["pairs"])
        if case[4] > 2:  # balanced: every chunk once over the ranks
            assert sorted(c for r in results for c in r["cases"][case]["chunks"]) == list(range(world * case[4]))


# ---- the micro model (fp32 loss and gradients; fp64 against each document alone) ---------------------------

def _rows(vocab: int) -> torch.Tensor:
    """Token ids [2, T + 1] whose inputs hold STARTS's documents, each ended by EOS (the last ones cut)."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab, (len(STARTS), T + 1), generator=generator)
    for b, row in enumerate(STARTS):
        for start in row[1:]:
            ids[b, start - 1] = EOS
    return ids


def _model(dtype: torch.dtype):
    model = perturb(zaya.build_model(zaya.get_preset("micro", temp_init=1.0, cca_time0=3, cca_time1=2), seed=0))
    model = model.to(dtype)
    for i, block in enumerate(model.blocks):  # biases that make the zero padding at a document's start matter
        block.attn.conv0_bias.data.normal_(generator=torch.Generator().manual_seed(2 * i))
        block.attn.conv1_bias.data.normal_(generator=torch.Generator().manual_seed(2 * i + 1))
    return model


def _model_worker(rank: int, world: int, dtype_name: str) -> dict:
    """Split against one device, both keeping the documents apart. fp32 differentiates the training loss; fp64 a
    random projection of the hidden states (the loss's logits are fp32 whatever the model's dtype), so that every
    gradient is an fp64 one, and compares the hidden states with each document's computed alone."""
    dist.init_process_group("gloo")
    dtype = getattr(torch, dtype_name)
    torch.set_default_dtype(dtype)
    model = _model(dtype)
    ids = _rows(model.config.vocab_size)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    documents = DocumentLayout.from_tokens(inputs, EOS)
    assert documents.starts == STARTS
    positions = document_positions(inputs, EOS)
    exact = dtype == torch.float64
    projection = torch.randn(len(STARTS), T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))

    def objective(split: ContextParallel | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        if split is None:
            local_inputs, local_targets, weight = inputs, targets, projection
            where = {"documents": packed_documents(inputs, EOS)}
        else:
            local_inputs, local_targets, weight = split.shard(inputs), split.shard(targets), split.shard(projection)
            where = {"sequence": split, "positions": split.positions(),
                     "documents": Documents(split.shard(positions), None)}
        if not exact:
            return None, model.loss(local_inputs, local_targets, **where) * (local_targets.numel() / targets.numel())
        hidden = model.hidden_states(local_inputs, **where)
        return hidden, (hidden * weight).sum()

    full_hidden, full = objective(None)
    full.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    alone = {}
    if exact:
        with torch.no_grad():
            for b, row in enumerate(STARTS):
                for s, e in zip(row, (*row[1:], T), strict=True):
                    alone[(b, s)] = model.hidden_states(inputs[b:b + 1, s:e])[0]
    cases = [(*layout, 2) for layout in LAYOUTS] + [("headtail", "allgather", 4)]
    results = {}
    for sharding, kernel, chunks in cases:
        model.zero_grad()
        base = ContextParallel(SequenceLayout(T, world, sharding), dist.group.WORLD, kernel)
        split = base.for_documents(documents, positions, chunks_per_rank=chunks)
        hidden, part = objective(split)
        part.backward()
        total, summed = summed_over_ranks(part, model)
        grads = {name: (grad - reference[name]).abs().max().item() for name, grad in summed.items()}
        outcome = {"objective": abs(total.item() - full.item()) / abs(full.item()), "grads": grads,
                   "missing": set(reference) - set(grads)}
        if exact:
            hidden = _gather(hidden.detach(), split.layout)
            outcome["hidden"] = (hidden - full_hidden.detach()).abs().max().item()
            outcome["alone"] = max((hidden[b, s:s + len(a)] - a).abs().max().item() for (b, s), a in alone.items())
        results[(sharding, kernel, chunks)] = outcome
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_the_model_with_documents_split_equals_one_device(world):
    """fp32, as training runs: the loss (relative) and every parameter gradient (absolute; the largest entries are
    about 0.3) within 1e-6 of one device's with the same documents kept apart."""
    for rank, result in enumerate(run_distributed(_model_worker, world, "float32", timeout=120)):
        for case, outcome in result.items():
            assert not outcome["missing"], (rank, case, outcome["missing"])
            assert outcome["objective"] <= 1e-6, (rank, case, outcome["objective"])
            assert max(outcome["grads"].values()) <= 1e-6, (rank, case, outcome["grads"])


def test_the_model_with_documents_split_is_exact_and_equals_each_document_alone():
    """fp64 at cp = 4, where only the order of sums differs: the hidden states equal one device's and each
    document's computed alone, and every gradient one device's, to 1e-10."""
    for rank, result in enumerate(run_distributed(_model_worker, 4, "float64", timeout=120)):
        for case, outcome in result.items():
            assert not outcome["missing"], (rank, case, outcome["missing"])
            worst = max(outcome["objective"], outcome["hidden"], outcome["alone"], *outcome["grads"].values())
            assert worst <= 1e-10, (rank, case, outcome)


# ---- compiled --------------------------------------------------------------------------------------------

def compiled_worker(rank: int, world: int, kernel: str = "ring", window: int | None = None,
                    chunks_per_rank: int = 4) -> list[int]:
    """The frames a compiled attention layer (of sliding `window`, if any) has compiled after each of four
    micro-batches, each with other documents and its own split over the ranks."""
    from torch._dynamo.testing import CompileCounter

    from zaya.model.attention import CompressedConvAttention
    from zaya.model.layers import RotaryEmbedding

    dist.init_process_group("gloo")
    config = zaya.get_preset("micro")
    layer = CompressedConvAttention(config, window)
    rotary = RotaryEmbedding(config.head_dim, config.rotary_dim, 10_000.0)
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter)
    base = ContextParallel(SequenceLayout(T, world), dist.group.WORLD, kernel)
    frames = []
    generator = torch.Generator().manual_seed(0)
    for step in range(4):  # other documents, and another balanced layout, every micro-batch
        starts = sorted({0, *torch.randint(1, T, (3 + 2 * step,), generator=generator).tolist()})
        documents = DocumentLayout((tuple(starts), STARTS[step % 2]), T)
        positions = documents.positions()
        split = base.for_documents(documents, positions, chunks_per_rank=chunks_per_rank, window=window)
        x = torch.randn(2, T, config.hidden_size, generator=generator)
        local = split.shard(positions)
        out = compiled(split.shard(x), (*rotary(local), rotary.partner), sequence=split,
                       documents=Documents(local, None))
        out.sum().backward()
        frames.append(counter.frame_count)
    dist.destroy_process_group()
    return frames


def test_a_compiled_layer_takes_every_micro_batch_without_compiling_again():
    """Each micro-batch brings a new split (its documents, its balanced layout): the graphs around the exchanges
    are compiled once."""
    for frames in run_distributed(compiled_worker, 2, timeout=120):
        assert frames[0] > 0 and frames[-1] == frames[0], frames
