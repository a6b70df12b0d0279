"""Counting the ops that make the host wait for the device, on the CPU: a dispatch mode records every op whose
output size or value must be read back (`.item()`, `bool(t)`, `nonzero`, `bincount`, ...), by the rule the
planner counts them with (`zaya.plan.timing.reads_device`)."""

from torch.utils._python_dispatch import TorchDispatchMode

from zaya.plan.timing import reads_device


class HostSyncs(TorchDispatchMode):
    """The names of the syncing ops dispatched inside, in order. `on_host(tensor)` names the tensors that live in
    host memory on every device (torch.optim's step counters), whose reads wait for nothing."""

    def __init__(self, on_host=lambda tensor: False):
        super().__init__()
        self.ops: list[str] = []
        self.on_host = on_host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_device(func, kwargs) and not (args and self.on_host(args[0])):
            self.ops.append(func._schema.name)
        return func(*args, **kwargs)
