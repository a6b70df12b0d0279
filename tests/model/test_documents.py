"""Packed documents kept apart: a row of several documents computes what each document computes alone (attention,
both convolutions, the value shift and RoPE all stop at a document's start), forward and backward."""

import pytest
import torch

from zaya.model.documents import document_positions, packed_documents

EOS = 1


def _documents(lengths, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]
    for document in documents:
        document[-1] = EOS
    return documents


def test_positions_count_from_each_document_start():
    ids = torch.tensor([[5, 1, 7, 8, 1, 1, 9], [4, 4, 4, 4, 4, 4, 1]])
    assert document_positions(ids, EOS).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]


# (tolerance of the outputs, of the gradients)
TOLERANCES = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 2e-4)}


# lengths: a one-token document, one longer than the short-input contraction, a row ending mid-document; with
# documents longer than the fused kernel's 32 queries and runs of ones shorter than the packs' 16 tokens
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lengths", [(5, 1, 11, 3), (2, 17), (40, 3, 1, 20, 70, 9, 6, 33)])
def test_a_packed_row_computes_each_document_alone(make_model, lengths, dtype):
    model = make_model("micro", cca_time0=3, cca_time1=2).to(dtype)
    for block in model.blocks:  # biases that make the padding at a document's start matter
        block.attn.conv0_bias.data.normal_(generator=torch.Generator().manual_seed(1))
        block.attn.conv1_bias.data.normal_(generator=torch.Generator().manual_seed(2))
    docs = _documents(lengths, model.config.vocab_size, seed=len(lengths))
    docs[-1] = docs[-1][:-1]  # the row ends inside its last document
    other = docs[:-1][::-1] + docs[-1:]  # the whole documents in another order
    rows = torch.stack([torch.cat(docs), torch.cat(other)])
    weight = torch.randn(rows.shape[1], model.config.hidden_size, dtype=dtype)
    packed = model.hidden_states(rows, documents=packed_documents(rows, EOS))
    (packed[0] * weight).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    alone = torch.cat([model.hidden_states(d[None])[0] for d in docs])
    (alone * weight).sum().backward()
    atol, grad_atol = TOLERANCES[dtype]
    torch.testing.assert_close(packed[0], alone, rtol=0, atol=atol)
    torch.testing.assert_close(packed[1], torch.cat([model.hidden_states(d[None])[0] for d in other]),
                               rtol=0, atol=atol)
    for packed_grad, param in zip(packed_grads, model.parameters(), strict=True):
        scale = 1 if dtype == torch.float64 else param.grad.abs().max().clamp_min(1)
        torch.testing.assert_close(packed_grad, param.grad, rtol=0, atol=grad_atol * scale)
    # without the positions the documents do see each other
    with torch.no_grad():
        assert (model.hidden_states(rows)[0] - alone).abs().max() > 0.1


def test_one_document_per_row_is_the_plain_forward(make_model):
    model = make_model("micro")
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids, documents=packed_documents(ids, EOS)),
                                   model.hidden_states(ids), rtol=0, atol=1e-5)


def test_the_plan_from_the_host_ids_is_the_plan_from_the_device():
    ids = torch.cat(_documents((40, 3, 1, 20, 70), 64, seed=3))[None].repeat(2, 1)
    ids[1, 50] = EOS
    read_back, planned = packed_documents(ids, EOS), packed_documents(ids, EOS, host_ids=ids.clone())
    assert torch.equal(read_back.positions, planned.positions) and torch.equal(read_back.segments, planned.segments)


def test_host_ids_of_another_shape_are_refused():
    ids = torch.ones(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"host_ids of shape \(2, 9\) for input_ids of shape \(2, 10\)"):
        packed_documents(ids, EOS, host_ids=ids[:, :9])


def test_packed_documents_need_their_segments_and_no_decode_cache(make_model):
    model = make_model("micro")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    documents = packed_documents(ids, EOS)
    with pytest.raises(ValueError, match=r"Documents\.segments is None"):
        model.hidden_states(ids, documents=documents._replace(segments=None))
    with pytest.raises(ValueError, match="not with a decode cache"):
        model.hidden_states(ids, cache=model.new_cache(), documents=documents)
