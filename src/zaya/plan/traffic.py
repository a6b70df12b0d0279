"""Bytes each GPU sends in one optimizer step, by collective and by mesh dimension, predicted with the
formulas `zaya.parallel.comm` counts real collectives with (bandwidth-optimal ring algorithms; an
all-gather of a shard of S bytes over N ranks sends S (N - 1), a reduce-scatter of S bytes S (N - 1) / N, an
all-reduce 2 S (N - 1) / N, an all-to-all the bytes addressed to others):

- FSDP2 (`zaya.parallel.fsdp`), per micro-batch (full sharding) or per step (ZeRO-2) and unit: one
  all-gather of its padded shards in the compute dtype in forward, another in backward if it reshards after
  forward (blocks do under full sharding on more than one rank), a reduce-scatter of its fp32 gradients, and
  with HSDP an all-reduce of the reduced fp32 shards over the replicas;
- distributed Muon (`zaya.optim.distributed`), per step: every matrix split over the FSDP ranks travels to its
  owner in fp32 (each rank of the owner's replica sends its rows) and back in the Newton-Schulz dtype to every
  replica; stacks of experts split along the expert dimension travel only back, to the other replicas;
- context parallelism (`zaya.parallel.context`, `cp_attention`), per micro-batch and layer: the halo (the
  last P packed vectors and one value-shift vector of each segment whose successor lives elsewhere, forward
  and backward) and the keys and values: (cp - 1) shards in forward, again in backward, and (cp - 1) shards
  of their gradients home, in fp32; with full activation checkpointing the forward's share is sent twice;
- the routers' gradients (whole on every rank, `zaya.parallel.fsdp.replicated_parameters`), per step: one fp32
  all-reduce over every rank;
- the trainer's own all-reduces: the gradient norm and the step's statistics.

Per rank the figure is the mean over the ranks of a group (owners send more than others in Muon's scatter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from zaya.model.config import ZayaConfig
from zaya.parallel.context import SequenceLayout, _halo_plan
from zaya.parallel.fsdp import collectives_per_step, gathers_per_micro_batch, shard_dim
from zaya.plan.inventory import inventory
from zaya.plan.layout import Layout

FP32 = 4
# which mesh dimension each counted kind of traffic runs over
DIMENSION = {"fsdp_all_gather": "dp_shard_cp", "fsdp_reduce_scatter": "dp_shard_cp",
             "fsdp_all_reduce": "dp_replicate", "muon_gather": "world", "muon_scatter": "world",
             "cp_kv": "cp", "cp_dkv": "cp", "cp_halo": "cp", "trainer": "world", "replicated": "world"}


@dataclass
class Traffic:
    """Bytes per rank and step by collective (the kinds `zaya.parallel.comm.CommCounter` counts)."""

    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())

    def by_dimension(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for kind, nbytes in self.by_kind.items():
            result[DIMENSION[kind]] = result.get(DIMENSION[kind], 0.0) + nbytes
        return result

    def add(self, kind: str, nbytes: float) -> None:
        if nbytes:
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + nbytes


def fsdp_traffic(config: ZayaConfig, layout: Layout, precision: str, micro_batches: int, traffic: Traffic) -> None:
    n, r = layout.shard_ranks, layout.dp_replicate
    times = collectives_per_step(layout.sharding, micro_batches)
    for unit in inventory(config).units:
        shard = unit.padded_shard_numel(n)
        param_bytes = 2 if precision == "bf16" and not unit.keep_fp32 else FP32
        gathers = gathers_per_micro_batch(unit, layout.sharding, n)
        traffic.add("fsdp_all_gather", times * gathers * shard * param_bytes * (n - 1))
        traffic.add("fsdp_reduce_scatter", times * shard * n * FP32 * (n - 1) / n)
        traffic.add("fsdp_all_reduce", times * 2 * shard * FP32 * (r - 1) / r)


def muon_traffic(config: ZayaConfig, layout: Layout, ns_dtype: str, traffic: Traffic) -> None:
    n, r = layout.shard_ranks, layout.dp_replicate
    if n * r == 1:
        return
    ns_bytes = 2 if ns_dtype in ("bfloat16", "bf16") else FP32
    gathered, returned = _muon_bytes(inventory(config), n, r)
    traffic.add("muon_gather", gathered * FP32 / (n * r))
    traffic.add("muon_scatter", returned * ns_bytes / (n * r))


def cp_traffic(config: ZayaConfig, layout: Layout, seq_len: int, kernel: str, sharding: str, micro_batches: int,
               traffic: Traffic) -> None:
    cp = layout.cp
    if cp == 1:
        return
    c = config
    local = seq_len // cp
    seq = SequenceLayout(seq_len, cp, sharding)
    halo_vector = (c.conv_padding * (c.query_latent + c.key_latent) + c.key_latent // 2) * FP32
    # each segment's tail that a segment on another rank needs, forward and backward, averaged over ranks
    sent_tails = sum(sum(split for rank2, split in enumerate(_halo_plan(seq, rank).send_splits) if rank2 != rank)
                     for rank in range(cp)) / cp
    halo = sent_tails * layout.micro_batch_size * halo_vector  # one direction, one layer
    kv_shard = 2 * c.num_key_value_heads * c.head_dim * local * layout.micro_batch_size * FP32
    forward_passes = 2 if layout.activation_checkpointing == "full" else 1
    layers = c.num_hidden_layers * micro_batches
    traffic.add("cp_halo", layers * halo * (forward_passes + 1))  # each forward, and backward's mirror
    traffic.add("cp_kv", layers * (forward_passes + 1) * (cp - 1) * kv_shard)
    if kernel == "allgather":
        traffic.add("cp_dkv", layers * kv_shard * (cp - 1))  # an all-to-all of cp - 1 shards of gradients
    else:
        traffic.add("cp_dkv", layers * (cp - 1) * kv_shard)  # each partial gradient hops cp - 1 times


def replicated_traffic(config: ZayaConfig, layout: Layout, traffic: Traffic) -> None:
    """The replicated parameters' (the routers') fp32 gradients, all-reduced over every rank once per step."""
    world = layout.gpus
    traffic.add("replicated", 2 * inventory(config).replicated_numel * FP32 * (world - 1) / world)


def trainer_traffic(config: ZayaConfig, layout: Layout, traffic: Traffic) -> None:
    world = layout.gpus
    if world == 1:
        return
    layers, routes = config.num_hidden_layers, config.num_experts + 1
    stats = (layers * routes + layers + 1 + 3 * world) * 8  # fp64, `Trainer._global_stats`
    traffic.add("trainer", 2 * stats * (world - 1) / world)
    # the gradient norm: one fp32 all-reduce per process group of the parameters (the FSDP mesh)
    n = layout.shard_ranks
    if n > 1:
        traffic.add("trainer", 2 * FP32 * (n - 1) / n)


@functools.lru_cache(maxsize=1024)
def _muon_bytes(inv, n: int, r: int) -> tuple[float, float]:
    """Elements sent, summed over the ranks of `r` replicas of `n` shards (`zaya.optim.distributed`): to the
    owners, every piece of a split matrix but the owner's, from the owner's replica only; back, every rank's
    part of every result but the owner's own, on every replica (a matrix a shard holds whole goes back to that
    shard on the other replicas only)."""
    gathered = returned = 0.0
    for param in inv.params:
        if not param.muon:
            continue
        if len(param.shape) == 3 and (n == 1 or shard_dim(param.shape, n) == 0):  # whole matrices per shard
            returned += param.numel * (r - 1)
        else:
            gathered += param.numel * (n - 1) / n
            returned += param.numel * (r - 1 / n)
    return gathered, returned


def step_traffic(config: ZayaConfig, layout: Layout, seq_len: int, precision: str, micro_batches: int,
                 ns_dtype: str = "bfloat16", cp_kernel: str = "allgather", cp_sharding: str = "headtail") -> Traffic:
    """The bytes rank 0 sends in one optimizer step of `micro_batches` micro-batches per rank."""
    traffic = Traffic()
    fsdp_traffic(config, layout, precision, micro_batches, traffic)
    muon_traffic(config, layout, ns_dtype, traffic)
    replicated_traffic(config, layout, traffic)
    cp_traffic(config, layout, seq_len, cp_kernel, cp_sharding, micro_batches, traffic)
    trainer_traffic(config, layout, traffic)
    return traffic
