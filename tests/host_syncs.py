"""Counting the ops that make the host wait for the device, on the CPU: a dispatch mode records every op whose
output size or value must be read back (`.item()`, `bool(t)`, `nonzero`, `bincount`, ...)."""

from torch.utils._python_dispatch import TorchDispatchMode

# ops whose output size or value the host must read from the device
ALWAYS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::unique", "aten::_unique2",
          "aten::unique_dim", "aten::unique_consecutive", "aten::masked_select"}


class HostSyncs(TorchDispatchMode):
    """The names of the syncing ops dispatched inside, in order. `on_host(tensor)` names the tensors that live in
    host memory on every device (torch.optim's step counters), whose reads wait for nothing."""

    def __init__(self, on_host=lambda tensor: False):
        super().__init__()
        self.ops: list[str] = []
        self.on_host = on_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        # repeat_interleave with tensor repeats (its .Tensor form, which the others call) sizes its output from
        # their sum, unless output_size is given
        unsized = func._overloadname == "Tensor" and name == "aten::repeat_interleave" and (
            kwargs.get("output_size") is None)
        if (name in ALWAYS or unsized) and not (args and self.on_host(args[0])):
            self.ops.append(name)
        return func(*args, **kwargs)
