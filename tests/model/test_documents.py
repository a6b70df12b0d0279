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


# lengths: a one-token document, one longer than the short-input contraction, a row ending mid-document
@pytest.mark.parametrize("lengths", [(5, 1, 11, 3), (2, 17)])
def test_a_packed_row_computes_each_document_alone(make_model, lengths):
    model = make_model("micro", cca_time0=3, cca_time1=2).double()
    for block in model.blocks:  # biases that make the padding at a document's start matter
        block.attn.conv0_bias.data.normal_(generator=torch.Generator().manual_seed(1))
        block.attn.conv1_bias.data.normal_(generator=torch.Generator().manual_seed(2))
    docs = _documents(lengths, model.config.vocab_size, seed=len(lengths))
    docs[-1] = docs[-1][:-1]  # the row ends inside its last document
    other = docs[:-1][::-1] + docs[-1:]  # the whole documents in another order
    rows = torch.stack([torch.cat(docs), torch.cat(other)])
    weight = torch.randn(rows.shape[1], model.config.hidden_size, dtype=torch.float64)
    packed = model.hidden_states(rows, documents=packed_documents(rows, EOS))
    (packed[0] * weight).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    alone = torch.cat([model.hidden_states(d[None])[0] for d in docs])
    (alone * weight).sum().backward()
    torch.testing.assert_close(packed[0], alone, rtol=0, atol=1e-10)
    torch.testing.assert_close(packed[1], torch.cat([model.hidden_states(d[None])[0] for d in other]),
                               rtol=0, atol=1e-10)
    for packed_grad, param in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, param.grad, rtol=0, atol=1e-9)
    # without the positions the documents do see each other
    with torch.no_grad():
        assert (model.hidden_states(rows)[0] - alone).abs().max() > 0.1


def test_one_document_per_row_is_the_plain_forward(make_model):
    model = make_model("micro")
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids, documents=packed_documents(ids, EOS)),
                                   model.hidden_states(ids), rtol=0, atol=1e-5)
