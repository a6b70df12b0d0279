"""`packed_attention` over the planner's segments equals softmax attention with the dense mask, forward and
backward, in fp64, fp32 and bf16, on the fused CPU kernel and on the explicit path (the one an accelerator without
a wired fused kernel runs), for grouped queries and sliding windows; chunk pairs merged as a context-parallel rank
merges them give the same; and at 8192 tokens no tensor of T x T elements is formed, in the operator or the
model's loss."""

import math
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zaya
import zaya.model.packed_attention as packed
import zaya.model.segment_attention as segment_attention
from zaya.model.documents import packed_documents
from zaya.model.masks import DocumentLayout, allowed
from zaya.model.packed_attention import packed_attention

# two rows of different documents: a long one (fused, and windowed tiles), short ones packed, one-token ones,
# one just past the fused kernel's size, and the row's end inside a document
STARTS = ((0, 1, 2, 9, 12, 45, 46, 50, 200), (0, 150, 151, 180, 188, 189, 195))
LENGTH = 220
TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2)}


def _inputs(dtype, groups: int, heads: int = 2, d: int = 8, batch: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, LENGTH, d, generator=generator, dtype=torch.float64).to(dtype)
               for h in (heads * groups, heads, heads))
    dout = torch.randn(batch, heads * groups, LENGTH, d, generator=generator, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _dense(q, k, v, layout: DocumentLayout):
    """The reference: explicit scores, the [B, T, T] mask from `allowed`, softmax, in fp64."""
    g = q.shape[1] // k.shape[1]
    T = layout.length
    first = torch.arange(T) - layout.positions()
    mask = torch.stack([allowed(0, T, 0, T, first[b], layout.window) for b in range(layout.batch)])[:, None]
    scores = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(g, 1)


def _packed(q, k, v, layout: DocumentLayout):
    first = torch.arange(layout.length) - layout.positions()
    return packed_attention(q, k, v, torch.from_numpy(layout.segments()), first, layout.window)


def _check(layout: DocumentLayout, dtype, groups: int):
    q, k, v, dout = _inputs(dtype, groups, batch=layout.batch)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = _packed(*leaves, layout)
    assert out.dtype == dtype and out.shape == q.shape
    grads = torch.autograd.grad(out, leaves, dout)
    reference_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    reference = _dense(*reference_leaves, layout)
    reference_grads = torch.autograd.grad(reference, reference_leaves, dout.double())
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference, atol=atol, rtol=rtol)
    for name, grad, expected in zip("qkv", grads, reference_grads, strict=True):
        assert grad.dtype == dtype
        scale = 1 if dtype != torch.bfloat16 else expected.abs().max().item()  # bf16: relative to the largest
        torch.testing.assert_close(grad.double(), expected, atol=atol * scale, rtol=rtol,
                                   msg=lambda m, n=name: f"d{n}: {m}")


@pytest.fixture(params=["fused", "explicit"])
def path(request, monkeypatch):
    """The fused CPU kernel, or the explicit scores (as where the device has no fused kernel) in small tiles,
    several per segment."""
    if request.param == "explicit":
        monkeypatch.setattr(segment_attention, "fused_block_attention", lambda device: None)
        monkeypatch.setattr(segment_attention, "_EXPLICIT_SCORES", 512)
    return request.param


@pytest.fixture(params=["fused", "explicit"])
def sized_path(request, monkeypatch):
    """The two paths, the explicit one in its own tiles."""
    if request.param == "explicit":
        monkeypatch.setattr(segment_attention, "fused_block_attention", lambda device: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_packed_attention_equals_the_dense_mask(path, dtype, groups):
    _check(DocumentLayout(STARTS, LENGTH), dtype, groups)


@pytest.mark.parametrize("window", [1, 5, 40, 100, 1000])
def test_packed_attention_with_a_sliding_window(path, window):
    for dtype in (torch.float64, torch.float32):
        _check(DocumentLayout(STARTS, LENGTH, window), dtype, 2)


def test_rows_of_the_same_documents(path):
    _check(DocumentLayout((STARTS[0],) * 3, LENGTH), torch.float64, 2)
    _check(DocumentLayout(((0,),), LENGTH), torch.float64, 4)  # one document: plain causal attention


def test_one_document_is_causal_attention():
    q, k, v, _ = _inputs(torch.float32, 4, batch=1)
    out = _packed(q, k, v, DocumentLayout(((0,),), LENGTH))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_segments_on_a_device_are_refused():
    q, k, v, _ = _inputs(torch.float32, 2, batch=1)
    layout = DocumentLayout(((0,),), LENGTH)
    with pytest.raises(ValueError, match="segments are on meta"):
        packed_attention(q, k, v, torch.from_numpy(layout.segments()).to("meta"), torch.zeros(1, LENGTH))


def test_the_segments_are_the_only_coupling():
    """A query's output depends on the keys and values of its document only: changing another document's
    changes nothing."""
    layout = DocumentLayout(STARTS, LENGTH)
    q, k, v, _ = _inputs(torch.float64, 2, batch=2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:200] += 1.0  # the third row-0 document from the end, [50, 200)
    v2[:, :, 50:200] -= 1.0
    a, b = _packed(q, k, v, layout), _packed(q, k2, v2, layout)
    assert torch.equal(a[0, :, :50], b[0, :, :50]) and torch.equal(a[0, :, 200:], b[0, :, 200:])
    assert (a[0, :, 50:200] - b[0, :, 50:200]).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 30])
def test_chunk_pairs_merge_into_the_whole(path, window):
    """The segments of each chunk against itself and each earlier chunk, run on the chunks' own tensors and
    merged into one accumulator per chunk (as a context-parallel rank does): the dense result, and the
    gradients added over the chunk pairs."""
    layout = DocumentLayout(STARTS, LENGTH, window)
    q, k, v, dout = _inputs(torch.float64, 2, batch=2)
    reference_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = _dense(*reference_leaves, layout)
    reference_grads = torch.autograd.grad(reference, reference_leaves, dout)
    B, Hq, T, d = q.shape
    q5, do5 = q.view(B, 2, Hq // 2, T, d), dout.view(B, 2, Hq // 2, T, d)
    first = torch.arange(T) - layout.positions()
    chunks = [(0, 37), (37, 100), (100, 101), (101, 160), (160, T)]
    plans = {(i, j): segment_attention.Segments(layout.segments(chunks[i], chunks[j]), chunks[i][0], chunks[j][0],
                                                first[:, slice(*chunks[i])], window)
             for i in range(len(chunks)) for j in range(i + 1)}
    out, lse = torch.zeros(q5.shape, dtype=q.dtype), torch.full(q5.shape[:-1], float("-inf"), dtype=q.dtype)
    for (i, j), plan in plans.items():
        qs, ks = slice(*chunks[i]), slice(*chunks[j])
        o, s = out[:, :, :, qs].clone(), lse[:, :, :, qs].clone()
        segment_attention.segments_forward(q5[:, :, :, qs], k[:, :, ks], v[:, :, ks], plan, d ** -0.5, o, s)
        out[:, :, :, qs], lse[:, :, :, qs] = o, s
    torch.testing.assert_close(out.view(q.shape), reference, atol=1e-10, rtol=1e-10)
    delta = (do5 * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q5), torch.zeros_like(k), torch.zeros_like(v)
    for (i, j), plan in plans.items():
        qs, ks = slice(*chunks[i]), slice(*chunks[j])
        parts = dq[:, :, :, qs].clone(), dk[:, :, ks].clone(), dv[:, :, ks].clone()
        segment_attention.segments_backward(q5[:, :, :, qs], k[:, :, ks], v[:, :, ks], plan, d ** -0.5,
                                            do5[:, :, :, qs], out[:, :, :, qs], lse[:, :, :, qs],
                                            delta[:, :, :, qs], *parts)
        dq[:, :, :, qs], dk[:, :, ks], dv[:, :, ks] = parts
    for grad, expected in zip((dq.view(q.shape), dk, dv), reference_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-10, rtol=1e-10)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside, the packed-attention operator's own body included
    (a custom op's body runs below the mode: it is run here as its plain functions, with the mode on)."""

    BODIES: ClassVar = {torch.ops.zaya.packed_attention.default: packed.attend,
              torch.ops.zaya.packed_attention_backward.default: packed.attend_backward}

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.BODIES.get(func)
        if body is not None:
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


def _starts(T: int, mean: int, seed: int = 0) -> tuple[int, ...]:
    lengths = np.random.default_rng(seed).integers(1, 2 * mean, size=2 * T // mean)
    ends = np.cumsum(lengths)
    return (0, *ends[ends < T].tolist())


@pytest.mark.parametrize("documents", ["short", "whole row"])
def test_no_tensor_of_the_row_squared(sized_path, documents):
    """T = 8192: documents of mean length 256, or one of the whole row; forward and backward form no tensor of
    T^2 elements, and with short documents none larger than q or the scores of the longest document."""
    T = 8192
    starts = _starts(T, 256) if documents == "short" else (0,)
    layout = DocumentLayout((starts,), T)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, 4, generator=generator, requires_grad=True) for h in (2, 1, 1))
    with LargestTensor() as sizes:
        _packed(q, k, v, layout).sum().backward()
    assert sizes.largest < T * T, (sizes.largest, sizes.op)
    if documents == "short":
        longest = max(layout.lengths(0))
        assert sizes.largest <= max(q.numel(), q.shape[1] * longest**2) < T * T / 100, (sizes.largest, sizes.op)
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


def test_no_tensor_of_the_row_squared_in_the_model():
    """The micro model's loss and backward over a row of 8192 tokens of short packed documents: the largest
    tensor is a few activations of the row (the convolutions' windows: 3 taps of 6 heads of 16)."""
    T, eos = 8192, 1
    model = zaya.build_model(zaya.get_preset("micro", num_hidden_layers=1), seed=0).train()
    ids = torch.randint(3, model.config.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    ids[0, list(_starts(T, 256))[1:]] = eos  # a document ends at each of these
    documents = packed_documents(ids[:, :-1], eos, host_ids=ids[:, :-1])
    with LargestTensor() as sizes:
        model.loss(ids[:, :-1], ids[:, 1:], documents=documents).backward()
    assert sizes.largest <= 4 * model.config.hidden_size * T < T * T, (sizes.largest, sizes.op)
