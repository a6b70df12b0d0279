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
  of their gradients home, in fp32; with full activation checkpointing the forward's share is sent twice.
  Sliding blocks whose window's reach, W - 1 keys, fits in the chunk before (`zaya.parallel.cp_window`) send
  instead each chunk's last W - 1 keys and values to the rank of the next chunk, in forward (in the autocast
  dtype), and their gradients back in backward (fp32), for the chunks whose neighbour lives elsewhere; a longer
  window sends what a `hybrid` block does;
- the routers' gradients (whole on every rank, `zaya.parallel.fsdp.replicated_parameters`), per step: one fp32
  all-reduce over every rank;
- the trainer's own all-reduces: the gradient norm and the step's statistics;
- expert parallelism (`parallel.ep`, torchtitan's): each rank keeps 1/ep of every block's experts, and FSDP2
  shards those over the expert-data-parallel group (edp = dp_shard x cp / ep ranks, `ep` apart), so that their
  all-gathers and reduce-scatters run over edp ranks on 1/ep of the bytes (the HSDP all-reduce of their
  shards is unchanged: shards of numel / (ep edp)); per micro-batch and MoE layer every token's hidden vector
  goes to the rank of its expert and its output comes back (two `all_to_all_single` in forward, two in
  backward, two more where the MoE is recomputed), in the autocast dtype; with uniform routing (ep - 1) / ep
  of them leave the rank (the skip route, which the router's bias all but closes, is counted as routed);
  each forward also exchanges the token counts (E / ep int64 to each other rank of the group).

Each figure is recorded with the mesh group it runs over (`Traffic.by_dimension`): the kinds are those
`zaya.parallel.comm.CommCounter` counts, and FSDP2 counts its experts' collectives with the others.
Per rank the figure is the mean over the ranks of a group (owners send more than others in Muon's scatter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from zaya.model.config import ZayaConfig
from zaya.parallel.context import SequenceLayout, _halo_plan
from zaya.parallel.cp_window import halo_fits
from zaya.parallel.fsdp import collectives_per_step, gathers_per_micro_batch, shard_dim
from zaya.plan.inventory import inventory
from zaya.plan.layout import Layout

FP32 = 4
INT64 = 8
# which mesh group each counted kind of traffic runs over, unless `Traffic.add` says otherwise: "edp" is the
# group of the ranks holding the same experts, "ep" a group of ep consecutive ranks that exchange tokens
DIMENSION = {"fsdp_all_gather": "dp_shard_cp", "fsdp_reduce_scatter": "dp_shard_cp",
             "fsdp_all_reduce": "dp_replicate", "muon_gather": "world", "muon_scatter": "world",
             "cp_kv": "cp", "cp_dkv": "cp", "cp_halo": "cp", "cp_window_kv": "cp", "cp_window_dkv": "cp",
             "trainer": "world", "replicated": "world", "experts": "ep"}
DIMENSIONS = ("dp_replicate", "dp_shard_cp", "edp", "ep", "cp", "world")


@dataclass
class Traffic:
    """Bytes per rank and step by collective (the kinds `zaya.parallel.comm.CommCounter` counts) and by the
    mesh group it runs over."""

    entries: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, dimension): bytes

    @property
    def by_kind(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for (kind, _), nbytes in self.entries.items():
            result[kind] = result.get(kind, 0.0) + nbytes
        return result

    @property
    def total(self) -> float:
        return sum(self.entries.values())

    def by_dimension(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for (_, dim), nbytes in self.entries.items():
            result[dim] = result.get(dim, 0.0) + nbytes
        return result

    def add(self, kind: str, nbytes: float, dimension: str | None = None) -> None:
        if nbytes:
            key = (kind, dimension or DIMENSION[kind])
            self.entries[key] = self.entries.get(key, 0.0) + nbytes


def fsdp_traffic(config: ZayaConfig, layout: Layout, precision: str, micro_batches: int, traffic: Traffic) -> None:
    times = collectives_per_step(layout.sharding, micro_batches)
    for kind, nbytes, group in _fsdp_bytes(inventory(config), layout.shard_ranks, layout.dp_replicate, layout.ep,
                                           layout.sharding, precision, times):
        traffic.add(kind, nbytes, group)


@functools.lru_cache(maxsize=1024)
def _fsdp_bytes(inv, shard_ranks: int, r: int, ep: int, sharding: str, precision: str,
                times: int) -> tuple[tuple[str, float, str | None], ...]:
    """(kind, bytes, mesh group) of a step's FSDP2 collectives, summed over the units (a layout search asks
    for the same mesh at every micro-batch and checkpointing)."""
    totals: dict[tuple[str, str | None], float] = {}

    def add(kind: str, nbytes: float, group: str | None) -> None:
        totals[kind, group] = totals.get((kind, group), 0.0) + nbytes

    for unit in inv.sharded_units(ep):
        n = unit.shard_ranks(shard_ranks)
        group = "edp" if unit.ep > 1 else "dp_shard_cp"
        shard = unit.padded_shard_numel(n)
        param_bytes = 2 if precision == "bf16" and not unit.keep_fp32 else FP32
        gathers = gathers_per_micro_batch(unit, sharding, n)
        add("fsdp_all_gather", times * gathers * shard * param_bytes * (n - 1), group)
        add("fsdp_reduce_scatter", times * shard * n * FP32 * (n - 1) / n, group)
        add("fsdp_all_reduce", times * 2 * shard * FP32 * (r - 1) / r, None)
    return tuple((kind, nbytes, group) for (kind, group), nbytes in totals.items())


def ep_traffic(config: ZayaConfig, layout: Layout, seq_len: int, precision: str, micro_batches: int,
               traffic: Traffic) -> None:
    """Expert parallelism's token exchange (see the module docstring), per step."""
    ep = layout.ep
    if ep == 1:
        return
    tokens = layout.micro_batch_size * seq_len // layout.cp
    vectors = 2 if precision == "bf16" else FP32
    forwards = 2 if layout.activation_checkpointing in ("moe", "full") else 1  # the recomputed MoE exchanges again
    exchange = tokens * config.hidden_size * vectors * (ep - 1) / ep  # one all_to_all_single
    counts = (ep - 1) * (config.num_experts // ep) * INT64
    per_layer = (2 * forwards + 2) * exchange + forwards * counts  # dispatch and combine, each way
    traffic.add("experts", micro_batches * config.num_hidden_layers * per_layer)


def muon_traffic(config: ZayaConfig, layout: Layout, ns_dtype: str, traffic: Traffic) -> None:
    n, r = layout.shard_ranks, layout.dp_replicate
    if n * r == 1:
        return
    ns_bytes = 2 if ns_dtype in ("bfloat16", "bf16") else FP32
    gathered, returned = _muon_bytes(inventory(config), n, r, layout.ep)
    traffic.add("muon_gather", gathered * FP32 / (n * r))
    traffic.add("muon_scatter", returned * ns_bytes / (n * r))


@dataclass(frozen=True)
class WindowHalo:
    """How a sliding block's attention runs over a split sequence with the halo kernel
    (`zaya.parallel.cp_window`): the window W, each rank's `chunks`, and the `sent` of them, on average over the
    ranks, whose next chunk lives on another rank (each sends its last W - 1 keys and values there)."""

    window: int
    chunks: int
    sent: float


def window_halo(config: ZayaConfig, seq_len: int, cp: int, chunks: int = 2) -> WindowHalo | None:
    """The `WindowHalo` of `config`'s sliding blocks over `cp` ranks of `chunks` chunks each (2: head-tail, 1:
    contiguous, more: packed documents' chunks dealt out by work, `parallel.cp_document_chunks`); None where
    they run the all-gather or ring kernel (no sliding blocks, cp = 1, or W - 1 keys past the chunk before)."""
    W = config.sliding_window if config.sliding_blocks else None
    if W is None or cp == 1 or not halo_fits(W, seq_len // (cp * chunks)):
        return None
    if chunks <= 2:
        sent = _sent_tails(seq_len, cp, "headtail" if chunks == 2 else "contiguous")
    else:  # dealt out by their work, a chunk's successor is elsewhere as often as a random rank is
        sent = chunks * (cp - 1) / cp
    return WindowHalo(W, chunks, sent)


def cp_traffic(config: ZayaConfig, layout: Layout, seq_len: int, kernel: str, sharding: str, micro_batches: int,
               traffic: Traffic, precision: str = "fp32", chunks: int | None = None) -> None:
    cp = layout.cp
    if cp == 1:
        return
    c = config
    local = seq_len // cp
    halo_vector = (c.conv_padding * (c.query_latent + c.key_latent) + c.key_latent // 2) * FP32
    sent_tails = _sent_tails(seq_len, cp, sharding)
    halo = sent_tails * layout.micro_batch_size * halo_vector  # one direction, one layer
    kv_shard = 2 * c.num_key_value_heads * c.head_dim * local * layout.micro_batch_size * FP32
    forward_passes = 2 if layout.activation_checkpointing == "full" else 1
    layers = c.num_hidden_layers * micro_batches
    traffic.add("cp_halo", layers * halo * (forward_passes + 1))  # each forward, and backward's mirror
    window = window_halo(c, seq_len, cp, chunks or (2 if sharding == "headtail" else 1))
    windowed = c.sliding_blocks * micro_batches if window is not None else 0
    whole = layers - windowed  # the layers whose keys and values travel whole
    traffic.add("cp_kv", whole * (forward_passes + 1) * (cp - 1) * kv_shard)
    if kernel == "allgather":
        traffic.add("cp_dkv", whole * kv_shard * (cp - 1))  # an all-to-all of cp - 1 shards of gradients
    else:
        traffic.add("cp_dkv", whole * (cp - 1) * kv_shard)  # each partial gradient hops cp - 1 times
    if windowed:
        tails = window.sent * layout.micro_batch_size * (window.window - 1) * 2 * c.key_latent
        traffic.add("cp_window_kv", windowed * forward_passes * tails * (2 if precision == "bf16" else FP32))
        traffic.add("cp_window_dkv", windowed * tails * FP32)


@functools.lru_cache(maxsize=256)
def _sent_tails(seq_len: int, cp: int, sharding: str) -> float:
    """Each segment's tail that a segment on another rank needs, averaged over the ranks."""
    seq = SequenceLayout(seq_len, cp, sharding)
    return sum(sum(split for rank2, split in enumerate(_halo_plan(seq, rank).send_splits) if rank2 != rank)
               for rank in range(cp)) / cp


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
    # the gradient norm: one fp32 all-reduce per process group of the parameters (the FSDP mesh; with expert
    # parallelism the experts' squares summed over their shards' group, then over the ep group that holds the
    # other experts: `zaya.parallel.dtensor.total_norm`)
    groups = (layout.shard_ranks, layout.expert_shard_ranks, layout.ep) if layout.ep > 1 else (layout.shard_ranks,)
    for size in groups:
        if size > 1:
            traffic.add("trainer", 2 * FP32 * (size - 1) / size)


@functools.lru_cache(maxsize=1024)
def _muon_bytes(inv, n: int, r: int, ep: int = 1) -> tuple[float, float]:
    """Elements sent, summed over the ranks of `r` replicas of `n` shards (`zaya.optim.distributed`): to the
    owners, every piece of a split matrix but the owner's, from the owner's replica only; back, every rank's
    part of every result but the owner's own, on every replica (a matrix a shard holds whole goes back to that
    shard on the other replicas only). With `ep` > 1 each of the ep groups of n / ep ranks that hold the same
    experts does this for its 1/ep of each stack of experts."""
    gathered = returned = 0.0
    for unit in inv.sharded_units(ep):
        ranks, groups = unit.shard_ranks(n), unit.ep
        for param in unit.params:
            if not param.muon:
                continue
            numel = param.numel * groups
            if len(param.shape) == 3 and (ranks == 1 or shard_dim(param.shape, ranks) == 0):  # whole matrices
                returned += numel * (r - 1)
            else:
                gathered += numel * (ranks - 1) / ranks
                returned += numel * (r - 1 / ranks)
    return gathered, returned


def step_traffic(config: ZayaConfig, layout: Layout, seq_len: int, precision: str, micro_batches: int,
                 ns_dtype: str = "bfloat16", cp_kernel: str = "allgather", cp_sharding: str = "headtail",
                 cp_chunks: int | None = None) -> Traffic:
    """The bytes rank 0 sends in one optimizer step of `micro_batches` micro-batches per rank; `cp_chunks`: the
    chunks per rank of a split sequence (None: those of `cp_sharding`)."""
    traffic = Traffic()
    fsdp_traffic(config, layout, precision, micro_batches, traffic)
    ep_traffic(config, layout, seq_len, precision, micro_batches, traffic)
    muon_traffic(config, layout, ns_dtype, traffic)
    replicated_traffic(config, layout, traffic)
    cp_traffic(config, layout, seq_len, cp_kernel, cp_sharding, micro_batches, traffic, precision, cp_chunks)
    trainer_traffic(config, layout, traffic)
    return traffic
