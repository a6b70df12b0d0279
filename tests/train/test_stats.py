"""The step's statistics: fields packed into one buffer, summed over ranks, unpacked by name and kind."""

import numpy as np
import torch

from zaya.train.stats import StepStats


def _fields(rank: int) -> StepStats:
    stats = StepStats(rank, 2, torch.device("cpu"))
    stats.sum("counts", torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]) * (rank + 1))
    stats.sum("loss", torch.tensor(0.5 + rank))
    stats.sum("signal", float(rank == 1))
    stats.per_rank("memory", 100.0 + rank)
    stats.per_rank("sent", 0.0)
    stats.from_main("deadline", 7.0)
    stats.same("norm", torch.tensor(float("inf")))  # every rank holds it: rank 0's arrives, even not finite
    stats.set("sent", 10.0 * (rank + 1))  # known only after the buffer's size
    return stats


def test_fields_are_summed_over_the_ranks_and_returned_by_name_and_shape():
    sent = {}
    first = _fields(0).reduce(lambda packed: sent.setdefault(0, packed.clone()))
    assert first["memory"].tolist() == [100.0, 0.0]  # rank 0's own slot only, before the sum

    def with_rank_0(packed: torch.Tensor) -> None:
        packed += sent[0]

    out = _fields(1).reduce(with_rank_0)
    assert out["counts"].shape == (2, 3)
    assert out["counts"].tolist() == [[3.0, 6.0, 9.0], [12.0, 15.0, 18.0]]
    assert float(out["loss"]) == 2.0
    assert float(out["signal"]) == 1.0
    assert out["memory"].tolist() == [100.0, 101.0]
    assert out["sent"].tolist() == [10.0, 20.0]
    assert float(out["deadline"]) == 7.0  # rank 0's value: the others send zero
    assert float(out["norm"]) == float("inf")
    assert all(isinstance(value, np.ndarray) and value.dtype == np.float64 for value in out.values())
    assert _fields(0).nbytes == 8 * (6 + 1 + 1 + 2 + 2 + 1 + 1)
