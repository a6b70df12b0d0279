"""A sharded model built without ever holding the whole model: `Zaya` is built on the meta device, sharded by
`zaya.parallel.fsdp.parallelize`, and `materialize` then gives each rank its shards with the values one process
gets from the same seed.

`Zaya.initializers` lists every parameter and buffer with what sets it, in the order of the random draws. Each is
applied to one whole tensor on the device, from the seeded generator, as one process applies it; the rank keeps
its shard of it and frees the rest before the next. The random stream is then one process's draw for draw, and
a rank's peak memory for the model is its shards plus the largest single tensor (ZAYA1-base: its 2.1 GB
embedding, against 35 GB for the whole fp32 model).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from zaya.errors import ZayaError
from zaya.parallel.dtensor import is_dtensor, local, shard_layout


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int,
                parts: Mapping[int, tuple[tuple[int, ...], int]] | None = None) -> nn.Module:
    """Allocate `model`'s tensors (on the meta device, sharded or not) on `device` and set them as a model built
    there in one process after `torch.manual_seed(seed)` has them. `parts` names (by id) the tensors that are
    slices along their first dimension of larger ones (a rank's experts under expert parallelism): the whole
    shape and the first row, so that they get their rows of the whole tensor's draw. Returns the model."""
    parts = parts or {}
    model.to_empty(device=device)
    torch.manual_seed(seed)
    done: set[int] = set()
    for tensor, fill in model.initializers():
        if is_dtensor(tensor) or id(tensor) in parts:
            shape, first = parts.get(id(tensor), (tuple(tensor.shape), None))
            whole = torch.empty(shape, dtype=tensor.dtype, device=device)
            fill(whole)
            if first is not None:
                whole = whole.narrow(0, first, tensor.shape[0])
            layout = shard_layout(tensor)
            if not layout.whole:
                start, stop = layout.bounds(whole.shape[layout.dim])
                whole = whole.narrow(layout.dim, start, stop - start)
            local(tensor).copy_(whole)
            del whole  # before the next one is made
        else:
            fill(tensor)
        done.add(id(tensor))
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in done]
    if missing:  # a tensor no initializer sets would keep whatever memory it was given
        raise ZayaError(f"the model's initializers do not set {', '.join(missing)}")
    return model
