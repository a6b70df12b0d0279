"""The loss's forward and backward read nothing back to the host: on an accelerator the CPU can then run ahead
and queue the kernels. Counted on the CPU by a dispatch mode that records the ops which block on the device."""

import pytest
import torch

import zaya
from host_syncs import HostSyncs
from zaya.model.loss import IGNORE_INDEX


def test_the_counter_sees_the_ops_that_sync():
    x = torch.tensor([3, 0, 2, 2])
    with HostSyncs() as syncs:
        torch.bincount(x)
        x.nonzero()
        float(x.sum())
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=7)  # sized: no sync
    assert syncs.ops == ["aten::bincount", "aten::nonzero", "aten::_local_scalar_dense", "aten::repeat_interleave"]


@pytest.mark.parametrize("blocks", [2, 8])
def test_the_loss_and_its_backward_never_read_the_device(blocks):
    config = zaya.get_preset("micro", num_hidden_layers=blocks)
    model = zaya.build_model(config, seed=0).train()
    batch = torch.randint(0, config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    targets = batch[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX  # the masked rows take the same path as the others
    with HostSyncs() as syncs:
        loss = model.loss(batch[:, :-1], targets)
        loss.backward()
    assert syncs.ops == []
    assert torch.isfinite(loss)


class _InsidePackedAttention(HostSyncs):
    """`HostSyncs` that also sees inside the packed-attention operator (a custom op's body runs below a dispatch
    mode: here it runs as its plain functions, with the mode on). Below autograd, `.item()` and `bool(t)` reach
    the mode as themselves, not as the `_local_scalar_dense` they call: counted too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from zaya.model import packed_attention

        body = {torch.ops.zaya.packed_attention.default: packed_attention.attend,
                torch.ops.zaya.packed_attention_backward.default: packed_attention.attend_backward}.get(func)
        if body is None:
            if func._schema.name in ("aten::item", "aten::is_nonzero"):
                self.ops.append(func._schema.name)
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self:
            return body(*args, **(kwargs or {}))


def test_packed_documents_never_read_the_device():
    """Packed documents planned from the host's copy of the ids: the loss and its backward, the attention's
    segments included, read nothing back (the plan is a host tensor, read as such)."""
    from zaya.model.documents import packed_documents

    config = zaya.get_preset("micro", num_hidden_layers=2)
    model = zaya.build_model(config, seed=0).train()
    batch = torch.randint(2, config.vocab_size, (2, 121), generator=torch.Generator().manual_seed(0))
    batch[:, [2, 3, 9, 50, 51, 90]] = 1  # one-token documents, packed ones, long ones
    documents = packed_documents(batch[:, :-1], 1, host_ids=batch[:, :-1].clone())
    with _InsidePackedAttention() as syncs:
        loss = model.loss(batch[:, :-1], batch[:, 1:], documents=documents)
        loss.backward()
    assert syncs.ops == []
    assert torch.isfinite(loss)
