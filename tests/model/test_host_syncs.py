"""The loss's forward and backward read nothing back to the host: on an accelerator the CPU can then run ahead
and queue the kernels. Counted on the CPU by a dispatch mode that records the ops which block on the device."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zaya
from zaya.model.loss import IGNORE_INDEX

# ops whose output size or value the host must read from the device
ALWAYS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::unique", "aten::_unique2",
          "aten::unique_dim", "aten::unique_consecutive", "aten::masked_select"}


class HostSyncs(TorchDispatchMode):
    """The names of the syncing ops dispatched inside, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        # repeat_interleave with tensor repeats (its .Tensor form, which the others call) sizes its output from
        # their sum, unless output_size is given
        unsized = func._overloadname == "Tensor" and name == "aten::repeat_interleave" and (
            kwargs.get("output_size") is None)
        if name in ALWAYS or unsized:
            self.ops.append(name)
        return func(*args, **kwargs)


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
