"""zaya.data: text into tokenized datasets, and datasets into per-rank training batches.

    report = build_dataset(BuildOptions(inputs=("corpus/",), out=Path("data/mine")))   # `zaya data build`
    dataset = open_dataset("data/mine")                      # .fingerprint, .split("train"), .check_vocab(...)
    ramp = BatchRamp(start=32, increment=32, final=256, ramp_samples=10_000)
    with TokenLoader([("data/mine", 1.0)], seq_len=2048, seed=0, rank=rank, world_size=world) as loader:
        batch = loader.next_batch(ramp.at(loader.consumed_samples))   # [B // world, seq_len + 1] int64
"""

from zaya.data.build import BuildOptions, BuildReport, build_dataset
from zaya.data.loader import TokenLoader
from zaya.data.order import GlobalOrder, OrderSource
from zaya.data.ramp import BatchRamp, batch_size_at
from zaya.data.shards import Dataset, open_dataset

__all__ = [
    "BatchRamp",
    "BuildOptions",
    "BuildReport",
    "Dataset",
    "GlobalOrder",
    "OrderSource",
    "TokenLoader",
    "batch_size_at",
    "build_dataset",
    "open_dataset",
]
