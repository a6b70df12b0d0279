"""Memory per GPU by component, predicted from the model config, the layout and the precision.

State (exact, from `zaya.plan.inventory`): FSDP2 keeps each parameter as an fp32 shard padded to the largest
rank's (FSDP2's `_sharded_param_data`), and its gradient in one padded fp32 reduce-scatter output per unit.
These fp32 shards are the master weights: bf16 mixed precision keeps no second copy, it casts the shards
when it gathers them (`master_weights` is 0 and listed so that the table reads like the papers' ones; ZeRO's
accounting, Rajbhandari et al. 2020, counts 4 + 4 + 4 bytes where we count 4 + 4). Muon keeps one momentum
and AdamW two moments per element (`zaya.optim.hybrid`), in fp32, on this rank's unpadded shard.

Activations (what autograd saves for backward, `zaya.plan.measure.activation_bytes` measures the same):
counted tensor by tensor from the model's forward code, per token and block, in the precision each tensor
is saved in. With bf16 autocast the matmul inputs are saved in bf16 (a = 2 bytes) and the fp32 residual
stream, the norms, the routers (always fp32) and the elementwise attention math in fp32 (f = 4); in fp32,
a = f. Writing D, Q, K, C = Q + K, G = H_q + H_k, R, E, F for the shapes (`zaya1-architecture.md`):

    attention sublayer   2Df + f (norm) + Da (projection input) + [(Q + 2K)f in fp32: its output] + Ca(1 + P/L)
                         (convolution input, L tokens per segment, P the convolutions' reach) + 2Cf + 3Gf
                         (q/k normalisation) + (Q + K)a + Ka (attention inputs) + Qa + H_q f (output,
                         log-sum-exp) + Df (residual scaling)
    MoE sublayer         2Df + f (norm) + Df + 6Rf + (E + 1)f + 17 (router) + rho (D + 4F)a (expert rows:
                         input, gate/up, SiLU, product; rho the padding of each expert's rows) + Da + a + 8
                         (output, weight, row index) + Df (residual scaling)
    per block            (Q + 2K)Da + C d (P + 1)a + G d (d + 1)a   (the derived input weight and kernels)
    outside the blocks   8 + 4Df + f per token (ids, embedding scaling, final norm, the loss's dL/dh)
                         + V D f (the loss's dL/dW, formed in its forward) + 2 (T/cp) d f (RoPE tables)

Packed documents kept apart (`isolate_documents`; `documents` below) change three terms and form no [T, T]
mask anywhere (`zaya.model.masks`): the convolutions contract each token's window of P + 1 packed vectors,
masked at its document's start, so they keep the windows, C (P + 1) a, and their mask, (P + 1) f, instead of
their input; the value shift keeps its mask, f; the RoPE tables are per row, 2 (tokens) d f. On one device the
packed attention (`zaya.model.packed_attention`) keeps each token's document start, 8, and its output is laid
out by heads, so that W_o keeps a copy of it, Qa (SDPA's output, laid out by tokens, is W_o's input as it is).

The attention's saved inputs and output, (Q + K)a + Ka + Qa above, are those of SDPA under autocast (its bf16
casts). The segment kernels, the packed attention of one device and the attention of context parallelism
(`zaya.parallel.cp_attention`, with or without documents), are autograd functions of their own that autocast
does not cast: they keep q, k, v and the output in the dtype they reach them in, the elementwise math's f,
(2Q + 2K)f.

Sliding blocks (`hybrid_sliding`, window W) save what the `hybrid` ones do, per block, but for one term: on
one device a row longer than W runs the segment operator over the window's band (`zaya.model.packed_attention`,
keeping q, k, v, the output and the log-sum-exp as SDPA does, and no document starts without packed documents),
whose output is laid out by heads, so that W_o keeps a copy of it, Qa (as with packed documents); a row of at
most W tokens runs SDPA's causal kernel. Their RoPE tables are their own: 2 (T/cp) d f more where both block types are
in the model (`zaya.model.transformer` forms each type's tables once, and a table no block uses is not kept).
The band's kernel runs tiles of t queries over their t + W - 1 keys (`zaya.model.masks`) with a boolean mask
and its additive form in the kernel's dtype, (1 + a) bytes an element, made once per tile shape and kept
(`band_mask`): the first W / t tiles' shapes and the full tiles' one, tens of MB at W = 4096, not a [T, T]
term; under context parallelism those of a chunk and of its block against the W - 1 keys before it. Split over
cp ranks, a window whose W - 1 keys fit in the chunk before runs the halo kernel (`zaya.parallel.cp_window`),
which keeps the keys and values it received for backward: 2 K a S (W - 1) / (T/cp) more per token (S chunks
per rank).

Activation checkpointing keeps instead, per block, the inputs of what it recomputes: "moe" the MoE
sublayer's input and router state (Df + Rf), "full" the block's (Df + Rf); the recomputed block's
activations then live during its backward (the `transient` component).

Transients (the largest wins, the others are freed first): one chunk of the fused LM-head loss (logits,
log-probabilities and their gradient, `zaya.model.loss`), or one recomputed block; the sliding band's masks
are kept beside it.
Communication buffers: FSDP2's unsharded parameters, which the root keeps from forward to backward (on one
rank every unit does, and under ZeRO-2 on any number: `zaya.parallel.fsdp`), two blocks' worth in flight
otherwise (the current and the prefetched one), and two blocks' unsharded gradients before their
reduce-scatter; under ZeRO-2 with more than one micro-batch, every gradient whole in fp32. The optimizer's
Newton-Schulz workspace (the matrices this rank owns, whole, `zaya.optim.distributed`) is needed after
backward, once activations are gone.

    total = parameters + gradients + optimizer state + max(activations + transient + buffers, workspace)

Expert parallelism (`parallel.ep`): a rank keeps 1/ep of each block's experts, sharded over the ep-th part of the
FSDP ranks that hold the same ones (`zaya.plan.inventory`), so its shards, gradients and optimizer state stay
about numel / (dp_shard x cp) (padding aside); what shrinks by ep is every whole copy of the experts: two
blocks' gathered experts in flight, every block's under ZeRO-2 and ZeRO-1 (kept whole across steps), and the
whole fp32 gradients ZeRO-2 accumulates. Activations are those of ep = 1: with uniform routing a rank's experts
receive as many rows as it sends (the exchange's buffers are transient and outlived by the loss's chunk), and
each of its E / ep experts pads its rows to the device's multiple.

Decoding (`decode_cache_bytes`): a block's cache holds the keys and values of every position, a sliding
block's of its last min(T, W) only (a ring of W slots), 2 H_k d a per position, and the convolutions' last
P packed vectors and the value shift's last vector, (P C + H_k d / 2) a. The positions are counted exactly:
the eager cache grows a `hybrid` block's buffer ahead of them (by doubling), a static one holds its capacity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zaya.model.config import ZayaConfig
from zaya.model.flops import block_windows
from zaya.model.masks import MASKED, DocumentLayout
from zaya.parallel.cp_window import halo_fits
from zaya.plan.inventory import Inventory, inventory
from zaya.plan.layout import Layout
from zaya.plan.traffic import window_halo

FP32 = 4
MODES = ("none", "moe", "full")


@dataclass(frozen=True)
class Precision:
    """Byte sizes of one run's tensors: `a` for matmul inputs under autocast, `f` for fp32."""

    name: str  # "bf16" or "fp32"

    @property
    def a(self) -> int:
        return 2 if self.name == "bf16" else FP32

    f: int = FP32


@dataclass(frozen=True)
class DeviceDetails:
    """What the model's code does differently per device (from `zaya.device`): the rows each expert's group
    is padded to a multiple of, and how many logits one chunk of the loss forms."""

    row_multiple: int = 1
    loss_chunk_logits: int = 1 << 28


GPU_DETAILS = DeviceDetails()


@dataclass
class Memory:
    """Bytes per GPU by component (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int
    activations: int
    transient: int
    communication_buffers: int
    optimizer_workspace: int

    @property
    def total(self) -> int:
        working = self.activations + self.transient + self.communication_buffers
        return self.parameters + self.gradients + self.optimizer_state + self.master_weights + \
            max(working, self.optimizer_workspace)

    def scaled(self, factor: float) -> Memory:
        """Every part times `factor` (a calibration, `zaya.plan.calibration`: what the run measured over what was
        predicted), in whole bytes."""
        return Memory(*(round(part * factor) for part in (
            self.parameters, self.gradients, self.optimizer_state, self.master_weights, self.activations,
            self.transient, self.communication_buffers, self.optimizer_workspace)))

    def to_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "master_weights": self.master_weights, "activations": self.activations, "transient": self.transient,
                "communication_buffers": self.communication_buffers,
                "optimizer_workspace": self.optimizer_workspace, "total": self.total}


# ---- state ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def state_bytes(inv: Inventory, shard_ranks: int, rank: int = 0, ep: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) of `rank` among `shard_ranks` FSDP2 ranks with `ep`
    expert-parallel ranks, in bytes; the replicated parameters (the routers) whole on every rank."""
    padded = optimizer = 0
    for unit in inv.sharded_units(ep):
        ranks = unit.shard_ranks(shard_ranks)
        place = rank // unit.ep  # the experts' shards go to the ranks ep apart that hold the same experts
        padded += sum(p.padded_shard_numel(ranks) for p in unit.params)
        optimizer += sum((1 if p.muon else 2) * p.shard_numel(ranks, place) for p in unit.params)
    padded += inv.replicated_numel
    optimizer += sum((1 if p.muon else 2) * p.numel for p in inv.replicated)
    return padded * FP32, padded * FP32, optimizer * FP32


# ---- activations ------------------------------------------------------------------------------------------


def _attention_per_token(c: ZayaConfig, p: Precision, segment: int, documents: bool = False,
                         kernel: str = "sdpa") -> float:
    """The attention sublayer's bytes per token; `documents`: packed documents kept apart; `kernel`: "sdpa"
    (one device, whole rows), "band" (one device, a sliding window shorter than the row), "packed" (one
    device, packed documents) or "split" (context parallelism)."""
    D, Q, K, G, Hq = c.hidden_size, c.query_latent, c.key_latent, c.num_attention_heads + c.num_key_value_heads, \
        c.num_attention_heads
    C, a, f, P = Q + K, p.a, p.f, c.conv_padding
    # in fp32 the projection's output is saved as it is; under autocast only its fp32 copy exists, unsaved
    projected = (Q + 2 * K) * f if a == f else 0
    # the convolutions' input, or with documents their masked windows, their mask and the value shift's mask
    convolution = C * (P + 1) * a + (P + 1) * f + f if documents else C * a * (1 + P / segment)
    # the attention's q, k, v and output, in the autocast dtype (the segment kernels are handed autocast copies
    # as SDPA makes them); the segment operator's output is laid out by heads, so W_o's input is a copy of it,
    # Qa more (SDPA's is laid out by tokens: W_o reads it as it is); with documents each token's document start
    saved = {"sdpa": (Q + K) * a + K * a + Q * a, "split": (2 * Q + 2 * K) * a, "band": (2 * Q + 2 * K) * a + Q * a,
             "packed": (2 * Q + 2 * K) * a + Q * a + 8}
    return (2 * D * f + f + D * a + projected + convolution + 2 * C * f + 3 * G * f + saved[kernel] + Hq * f
            + D * f)


def _moe_outside_per_token(c: ZayaConfig) -> float:
    """The MoE sublayer's norm and residual scaling, outside what "moe" checkpointing recomputes."""
    return 3 * c.hidden_size * FP32 + FP32


def _moe_inside_per_token(c: ZayaConfig, p: Precision, rho: float) -> float:
    D, R, E, F_, a, f = c.hidden_size, c.router_hidden_size, c.num_experts, c.moe_intermediate_size, p.a, p.f
    router = D * f + 6 * R * f + f + (E + 1) * f + 17
    experts = rho * (D + 4 * F_) * a + D * a + a + 8 + (f if c.skip_route == "identity" else 0)
    return router + experts


def _block_constants(c: ZayaConfig, p: Precision) -> float:
    D, Q, K, d, G = c.hidden_size, c.query_latent, c.key_latent, c.head_dim, \
        c.num_attention_heads + c.num_key_value_heads
    return (Q + 2 * K) * D * p.a + (Q + K) * d * (c.conv_padding + 1) * p.a + G * d * (d + 1) * p.a


def _kept_inputs_per_token(c: ZayaConfig) -> int:
    return (c.hidden_size + c.router_hidden_size) * FP32


def row_padding(config: ZayaConfig, tokens: int, details: DeviceDetails, ep: int = 1) -> float:
    """The grouped GEMMs' rows over the tokens they take: each of a rank's E / ep experts pads its rows to a
    multiple, on average by half a multiple (a rank's experts receive about `tokens` rows in all)."""
    return 1 + config.num_experts // ep * (details.row_multiple - 1) / 2 / max(tokens, 1)


def attention_kernel(cp: int, documents: bool, seq_len: int, window: int | None = None) -> str:
    """Which attention a block of `window` (None: a `hybrid` block) runs, as its saved tensors go: "split"
    (context parallelism), "packed" (one device, packed documents), "band" (one device, a sliding block's rows
    longer than its window: the segment operator over the band) or "sdpa" (SDPA's causal kernel)."""
    if cp > 1:
        return "split"
    if documents:
        return "packed"
    return "band" if window is not None and seq_len > window else "sdpa"


def activation_bytes(config: ZayaConfig, tokens: int, seq_len: int, cp: int, precision: str, mode: str,
                     details: DeviceDetails = GPU_DETAILS, ep: int = 1, documents: bool = False,
                     cp_chunks: int = 2) -> tuple[int, int]:
    """(saved, transient recompute) activation bytes of one micro-batch of `tokens` local tokens (sequences of
    `seq_len` split over `cp` ranks, in `cp_chunks` chunks each) under checkpointing `mode` with `ep`
    expert-parallel ranks, packed `documents` kept apart or not; see the module docstring."""
    c, p = config, Precision(precision)
    local = seq_len // cp
    segment = local // (2 if cp > 1 else 1)  # head-tail sharding: two runs per rank
    rho = row_padding(c, tokens, details, ep)
    windows = block_windows(c)  # the blocks of each attention: `hybrid`, and sliding ones of their window
    attention = {window: _attention_per_token(c, p, segment, documents, attention_kernel(cp, documents, seq_len,
                                                                                          window))
                 for window in windows}
    halo = window_halo(c, seq_len, cp, cp_chunks)
    if halo is not None:  # the keys and values the halo kernel received, kept for backward
        attention[halo.window] += 2 * c.key_latent * p.a * halo.chunks * (halo.window - 1) / local
    attention_all = sum(blocks * attention[window] for window, blocks in windows.items())  # per token, every block
    moe_outside, moe = _moe_outside_per_token(c), _moe_inside_per_token(c, p, rho)
    constants = _block_constants(c, p)
    kept = _kept_inputs_per_token(c)
    L = c.num_hidden_layers
    if mode == "none":
        blocks, recompute = tokens * (attention_all + L * (moe_outside + moe)) + L * constants, 0.0
    elif mode == "moe":
        blocks, recompute = tokens * (attention_all + L * (moe_outside + kept)) + L * constants, tokens * moe
    else:
        blocks = L * tokens * kept
        recompute = tokens * (max(attention.values()) + moe_outside + moe) + constants
    D = c.hidden_size
    rope_rows = tokens if documents else local  # each row's own positions, or the one sequence's
    rope = 2 * rope_rows * c.head_dim * FP32 * len(windows)  # each block type's tables
    outside = tokens * (8 + 4 * D * FP32 + FP32) + c.vocab_size * D * FP32 + rope
    return int(blocks + outside), int(recompute)


def window_mask_bytes(config: ZayaConfig, seq_len: int, cp: int, precision: str, cp_chunks: int = 2) -> int:
    """The masks of a sliding block's band, boolean and additive (see the module docstring): one per shape of
    tile in the plan of a row (under context parallelism, of a chunk's queries against its own keys and those
    before it), each made once and kept; 0 without sliding blocks, or where no row is longer than the window."""
    W = config.sliding_window if config.sliding_blocks else None
    if W is None or (cp == 1 and seq_len <= W):
        return 0
    return _band_mask_area(seq_len, W, cp * cp_chunks if cp > 1 else 1) * (1 + Precision(precision).a)


@functools.lru_cache(maxsize=64)
def _band_mask_area(length: int, window: int, chunks: int) -> int:
    """Elements of the distinct masks (`zaya.model.masks.band_mask`: one per shape and offset) of a row of
    `length` tokens under `window`, or of one of its `chunks` chunks far enough in to see a whole window: its
    own band, and its queries against the W - 1 keys before it (the halo kernel) or against each chunk before
    it (the all-gather and ring kernels)."""
    plan = DocumentLayout(((0,),), length, window)
    L = length // chunks
    c = min(chunks - 1, -(-window // L) + 1)
    queries = (c * L, (c + 1) * L)
    tables = [plan.segments(queries)]
    if chunks > 1 and halo_fits(window, L):
        tables.append(plan.segments(queries, (c * L - window + 1, c * L)))
    elif chunks > 1:
        tables += [plan.segments(queries, (k * L, (k + 1) * L)) for k in range(c)]
    return sum(rows * keys for rows, keys, _ in band_shapes(tables))


def band_shapes(tables) -> set[tuple[int, int, int]]:
    """The (queries, keys, offset) of the MASKED segments of segment tables: what `band_mask` makes one of."""
    return {(q1 - q0, k1 - k0, q0 - k0) for table in tables for _, q0, q1, k0, k1, kind in table.tolist()
            if kind == MASKED}


def loss_chunk_bytes(config: ZayaConfig, tokens: int, precision: str, details: DeviceDetails) -> int:
    """The fused loss's largest transient: one chunk of logits, log-probabilities (fp32) and their gradient,
    and the casts of the hidden states and of the embedding to the matmul dtype where they differ."""
    V, D = config.vocab_size, config.hidden_size
    rows = min(tokens, max(16, details.loss_chunk_logits // V))
    mm = FP32 if config.fp32_logits else Precision(precision).a
    casts = (tokens * D + V * D) * mm if mm != FP32 else 0
    return rows * V * (mm + FP32 + mm) + casts


# ---- buffers ----------------------------------------------------------------------------------------------


def _unit_bytes(unit, precision: str) -> int:
    return unit.numel * (FP32 if unit.keep_fp32 or precision != "bf16" else 2)


@functools.lru_cache(maxsize=256)
def buffer_bytes(inv: Inventory, shard_ranks: int, precision: str, sharding: str = "full",
                 micro_batches: int = 1, ep: int = 1) -> int:
    """FSDP2's unsharded parameters and gradients in flight (see the module docstring). Under ZeRO-2 every unit
    stays gathered for the whole step (under ZeRO-1 for good), and with more than one micro-batch every
    gradient is kept whole in fp32 until the last one reduces it. With `ep` expert-parallel ranks a block's
    experts are gathered whole only to this rank's 1/ep of them."""
    blocks = [u.split(ep) for u in inv.units if u.block]
    grads = [sum(part.numel for part in parts) * (FP32 + (2 if precision == "bf16" else FP32))
             for parts in blocks] or [0]
    root = sum(_unit_bytes(u, precision) for u in inv.units if not u.block)
    gathered = 0
    for experts in (False, True):  # the experts stay whole where their group is one rank (ep = dp_shard x cp)
        per_block = [sum(_unit_bytes(part, precision) for part in parts if (part.ep > 1) == experts)
                     for parts in blocks] or [0]
        whole = shard_ranks // (ep if experts else 1) == 1 or sharding != "full"
        gathered += sum(per_block) if whole else 2 * max(per_block)
    whole_numel = sum(unit.numel for unit in inv.sharded_units(ep))
    accumulated = whole_numel * FP32 if sharding != "full" and micro_batches > 1 else 0
    return root + gathered + accumulated + 2 * max(grads)


@functools.lru_cache(maxsize=256)
def workspace_bytes(inv: Inventory, shard_ranks: int, ns_bytes: int, replicas: int = 1) -> int:
    """Newton-Schulz workspace: this rank's share of the whole matrices it orthogonalises (owners are spread
    over every replica's shards), each as fp32 update plus three iteration buffers."""
    muon = [p for p in inv.params if p.muon]
    share = sum(p.numel for p in muon) / (shard_ranks * replicas)
    return int(share * (FP32 + 3 * ns_bytes))


# ---- everything -------------------------------------------------------------------------------------------


def memory_per_gpu(config: ZayaConfig, layout: Layout, seq_len: int, precision: str, ns_dtype: str = "bfloat16",
                   details: DeviceDetails = GPU_DETAILS, mode: str | None = None, micro_batches: int = 1,
                   documents: bool = False, cp_chunks: int = 2) -> Memory:
    """The `Memory` of rank 0 (the largest shard) of a run of `layout` on sequences of `seq_len` tokens and
    `micro_batches` micro-batches a step; `mode` overrides the layout's activation checkpointing; `documents`:
    packed documents kept apart; `cp_chunks`: the chunks per rank of a split sequence."""
    inv = inventory(config)
    params, grads, optimizer = state_bytes(inv, layout.shard_ranks, 0, layout.ep)
    tokens = layout.micro_batch_size * seq_len // layout.cp
    saved, recompute = activation_bytes(config, tokens, seq_len, layout.cp, precision,
                                        mode or layout.activation_checkpointing, details, layout.ep, documents,
                                        cp_chunks)
    # a sliding block's mask lives during its attention, beside a recomputed block, never beside the loss
    # the band's masks are kept from their first use on, beside whichever transient is the largest
    masks = window_mask_bytes(config, seq_len, layout.cp, precision, cp_chunks)
    transient = max(recompute, loss_chunk_bytes(config, tokens, precision, details)) + masks
    ns_bytes = 2 if ns_dtype in ("bfloat16", "bf16") else FP32
    return Memory(parameters=params, gradients=grads, optimizer_state=optimizer, master_weights=0,
                  activations=saved, transient=transient,
                  communication_buffers=buffer_bytes(inv, layout.shard_ranks, precision, layout.sharding,
                                                     micro_batches, layout.ep),
                  optimizer_workspace=workspace_bytes(inv, layout.shard_ranks, ns_bytes, layout.dp_replicate))


# ---- decoding ---------------------------------------------------------------------------------------------


def decode_cache_bytes(config: ZayaConfig, positions: int, batch: int = 1, precision: str = "bf16") -> int:
    """Bytes of the decode cache of `batch` sequences that have seen `positions` tokens, in the dtype of
    `precision`'s matmuls (see the module docstring): every position's keys and values in a `hybrid` block,
    the last min(positions, W) in a sliding one."""
    c, a = config, Precision(precision).a
    held = sum(blocks * (positions if window is None else min(positions, window))
               for window, blocks in block_windows(c).items())
    states = c.num_hidden_layers * (c.conv_padding * c.conv_channels + c.key_latent // 2)
    return batch * (2 * c.key_latent * held + states) * a
