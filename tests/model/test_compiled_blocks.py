"""`train.compile`: every block compiles to one graph (`fullgraph=True`), forward and backward, and the blocks
share their code whatever the depth: block 0 (no previous router state) and the others are the only two
graphs (two more once the sequence length changes, for any length then). Traced here through AOT autograd
with fake tensors (the `aot_eager` backend: what inductor is handed, run without generating code); these
replace a test that ran inductor's C++ code generation for one block (about a minute on two cores).
`benchmarks/train_step.py` runs inductor on every block."""

import torch
from torch._dynamo.utils import counters

import zaya
from zaya.model.transformer import RouterStats


def _step(model, batch, autocast: bool):
    model.zero_grad(set_to_none=True)
    stats = RouterStats(len(model.blocks), model.config.num_experts + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.loss(batch[:, :-1], batch[:, 1:], router_stats=stats)
    loss.backward()
    return loss.detach(), stats


def _assert_same_training(eager, compiled, batches, autocast: bool, tolerance: float):
    for batch in batches:  # new token ids each step: new expert group sizes
        (loss_e, stats_e), (loss_c, stats_c) = _step(eager, batch, autocast), _step(compiled, batch, autocast)
        torch.testing.assert_close(loss_c, loss_e, atol=tolerance, rtol=tolerance)
        assert torch.equal(stats_c.counts, stats_e.counts) and stats_c.tokens == stats_e.tokens
        for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            g_eager, g_compiled = p_eager.grad, p_compiled.grad
            assert (g_eager is None) == (g_compiled is None), name
            if g_eager is not None:
                scale = g_eager.abs().max().clamp_min(1e-6)
                assert (g_compiled - g_eager).abs().max() <= tolerance * scale, name


def _batches(config, count: int, length: int = 49):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (2, length), generator=generator) for _ in range(count)]


def test_every_block_is_one_graph_and_the_blocks_share_two():
    # bf16 autocast here; fp32, whose grouped matmuls need a shape function of zaya's, in tests/train/test_compile.py
    config = zaya.get_preset("micro", num_hidden_layers=5)
    eager = zaya.build_model(config, seed=3).train()
    compiled = zaya.build_model(config, seed=3).train()
    torch._dynamo.reset()
    counters.clear()
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend="aot_eager")
    _assert_same_training(eager, compiled, _batches(config, 2), True, 2e-2)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


def test_another_sequence_length_is_traced_once_more_for_any_length():
    """A phase's or an evaluation's length: each block graph is traced again once, the length symbolic (dynamo
    alone, the `eager` backend: the attention kernel once refused the symbolic causal flag that made)."""
    config = zaya.get_preset("micro", num_hidden_layers=2)
    model = zaya.build_model(config, seed=3).train()
    torch._dynamo.reset()
    counters.clear()
    for block in model.blocks:
        block.compile(fullgraph=True, backend="eager")
    for length in (49, 33, 41):
        batch = _batches(config, 1, length)[0]
        model.loss(batch[:, :-1], batch[:, 1:]).backward()
    assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"]



def test_the_whole_loss_is_one_graph_at_any_depth():
    """`torch.compile(model.loss, fullgraph=True)`: in fp32 forward and backward equal eager to 1e-5; the loop over
    the blocks unrolls into the one frame, so a deeper model is no more frames (bf16 autocast, traced only)."""
    config = zaya.get_preset("micro", num_hidden_layers=4)
    eager = zaya.build_model(config, seed=3).train()
    compiled = zaya.build_model(config, seed=3).train()
    torch._dynamo.reset()
    counters.clear()
    compiled.loss = torch.compile(compiled.loss, fullgraph=True, backend="aot_eager")
    _assert_same_training(eager, compiled, _batches(config, 2), False, 1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    deep = zaya.build_model(zaya.get_preset("micro", num_hidden_layers=9), seed=3).train()  # past dynamo's 8
    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(deep.loss, fullgraph=True, backend="eager")
    batch = _batches(deep.config, 1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(loss(batch[:, :-1], batch[:, 1:]), deep.loss(batch[:, :-1], batch[:, 1:]))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_packed_documents_stay_in_one_graph():
    """`model.loss` with packed documents compiles to one graph (the attention's segments a host tensor fed to
    one custom op), forward and backward equal to eager in fp32; batches with other documents, so other numbers
    of segments, trace it once more (the segment count symbolic) and then never again."""
    from zaya.model.documents import packed_documents

    config = zaya.get_preset("micro", num_hidden_layers=1)
    eager = zaya.build_model(config, seed=3).train()
    compiled = zaya.build_model(config, seed=3).train()
    torch._dynamo.reset()
    counters.clear()
    compiled_loss = torch.compile(compiled.loss, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    counts = []
    for ends in ([40, 80], [3, 4, 40, 90], [2, 50, 51, 52, 90]):
        batch = torch.randint(2, config.vocab_size, (2, 121), generator=generator)
        batch[0, ends] = 1
        batch[1, [e + 1 for e in ends]] = 1
        documents = packed_documents(batch[:, :-1], 1, host_ids=batch[:, :-1])
        counts.append(len(documents.segments))
        losses = []
        for model, loss in ((eager, eager.loss), (compiled, compiled_loss)):
            model.zero_grad(set_to_none=True)
            losses.append(loss(batch[:, :-1], batch[:, 1:], documents=documents))
            losses[-1].backward()
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
        for p_eager, p_compiled in zip(eager.parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, atol=1e-5, rtol=1e-5)
    assert len(set(counts)) == 3, counts
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
