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
