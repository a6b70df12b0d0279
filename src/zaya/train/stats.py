"""The step's statistics, summed over the ranks by one all-reduce: fields by name, packed into one float64 buffer.

    sum        a number or a tensor of any shape, summed (route counts stay exact: far below 2^53)
    same       a tensor every rank holds alike (a global norm): rank 0's, sent along (the others send zero)
    per_rank   one number per rank, each rank filling its own slot: after the sum, every rank's value
    from_main  rank 0's number (the others send zero): its clock and its deadline decide for every rank

What comes back is on the host, as numpy arrays: the one copy back is the only time the step waits for the
device, and reading the numbers then waits for nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# how often a training step reads the device back: its statistics, once (the planner charges it)
HOST_READS_PER_STEP = 1


class StepStats:
    """The fields of one step's reduction; `reduce` sends them and returns them by name."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._fields: dict[str, tuple[torch.Size, torch.Tensor | float, int | None]] = {}

    def sum(self, name: str, value: torch.Tensor | float) -> None:
        shape = value.shape if isinstance(value, torch.Tensor) else torch.Size()
        self._fields[name] = (shape, value, None)

    def same(self, name: str, value: torch.Tensor) -> None:
        self.sum(name, value if self.rank == 0 else torch.zeros_like(value))

    def per_rank(self, name: str, value: float) -> None:
        self._fields[name] = (torch.Size([self.world_size]), float(value), self.rank)

    def from_main(self, name: str, value: float) -> None:
        self.sum(name, float(value) if self.rank == 0 else 0.0)

    def set(self, name: str, value: float) -> None:
        """Replace a field's value, keeping its kind (what is known only once the buffer's size is)."""
        shape, _, slot = self._fields[name]
        self._fields[name] = (shape, float(value), slot)

    @property
    def nbytes(self) -> int:
        return 8 * sum(shape.numel() for shape, _, _ in self._fields.values())

    def reduce(self, all_reduce: Callable[[torch.Tensor], None]) -> dict[str, np.ndarray]:
        """Every field summed over the ranks (float64, in its shape; per-rank fields as [world_size]), on the host:
        the numbers go to the device in one copy and come back in one, whatever the number of fields."""
        numbers = torch.zeros(self.nbytes // 8, dtype=torch.float64)  # the buffer, with the tensors' places empty
        tensors, offset = [], 0
        for shape, value, slot in self._fields.values():
            if isinstance(value, torch.Tensor):
                tensors.append((offset, value))
            else:
                numbers[offset + (slot or 0)] = value
            offset += shape.numel()
        packed = numbers.to(self.device, non_blocking=True)
        for start, value in tensors:
            packed[start:start + value.numel()] = value.flatten()
        all_reduce(packed)
        host, out, offset = packed.cpu().numpy(), {}, 0
        for name, (shape, _, _) in self._fields.items():
            out[name] = host[offset:offset + shape.numel()].reshape(shape)
            offset += shape.numel()
        return out
