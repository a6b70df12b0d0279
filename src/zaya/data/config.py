"""`[data]` of a run config, and a source of a mixture: what the loader is built from (no numpy needed to read
them)."""

from __future__ import annotations

from dataclasses import dataclass

# the sample order's two-level shuffle (zaya.data.order)
DEFAULT_BLOCK_SIZE = 64
DEFAULT_GROUP_BLOCKS = 32


@dataclass
class Source:
    """A dataset (a `zaya data build` output directory) and its weight in a mixture."""

    path: str  # a dataset directory (a `zaya data build` output)
    weight: float = 1.0  # its share of the phase's samples, relative to the other sources' weights


@dataclass
class DataSection:
    path: str = ""  # the default source; phases may name their own mixtures
    seq_len: int = 512  # tokens per training sequence (a phase may set its own)
    # Batch-size ramp in sequences (Megatron's rule); ramp_samples = 0 means the full batch from the start.
    ramp_start: int = 0  # the global batch size the ramp starts at
    ramp_increment: int = 0  # sequences added to the batch at each step of the ramp
    ramp_samples: int = 0  # consumed sequences over which the batch grows to train.global_batch_size
    # The sample order's two-level shuffle (zaya.data.order). Large blocks read few places on disk; a short run
    # on a small corpus wants block_size 1, or its first thousand steps see a few dozen places of it only.
    block_size: int = DEFAULT_BLOCK_SIZE  # consecutive sequences that stay together (1: each from anywhere)
    group_blocks: int = DEFAULT_GROUP_BLOCKS  # blocks whose sequences are shuffled together
    # Documents packed into one sequence kept apart: attention, the convolutions and the value shift stop at
    # each document's start, RoPE counts from it (zaya.model.documents); a phase may set its own
    isolate_documents: bool = False
