"""Step time, predicted from the GEMMs the step runs, the bytes its elementwise work moves, its operator count
and the collectives it waits for.

    compute   = sum over the step's GEMMs of FLOPs / rate(shape)            (forward, both backward products,
                                                                              recomputation, the fused loss,
                                                                              Newton-Schulz)
              + attention FLOPs / attention rate                             (causal: T (T + 1) / 2 pairs;
                                                                              packed documents of mean length
                                                                              m kept apart: T (m + 1) / 2;
                                                                              a sliding block's band of tiles,
                                                                              about T (W + t - 1); per block
                                                                              type, `zaya.plan.documents`)
              + elementwise bytes / memory bandwidth
              + host                                    (see below)
    step      = compute + exposed communication

    host      = kernels issued x the cost of issuing one   (on accelerators only what outruns the kernels,
                                                            which run asynchronously)
              + host reads x (one round trip + one launch)  (on accelerators: each drains the queue, and the
                                                            device waits for the host to fill it again)

Rates come from a measured table (`zaya shapes`, the `local` device) or, for a published device, a roofline:
min(peak x its GEMM efficiency, arithmetic intensity x memory bandwidth). Elementwise work is counted from
the activations: each saved byte is written in forward and read in backward, and its gradient written and
read once (4 passes); the loss adds ~16 bytes per logit (log-softmax, exp, the one-hot subtraction); AdamW
moves 28 bytes per element (reads p, g, m, v; writes p, m, v), Muon's momentum and update 24, clipping 8;
FSDP2's copies into and out of its collective buffers are counted per collective (`fsdp_copy_bytes`; under
ZeRO-2 with the accumulation of whole fp32 gradients over the micro-batches).
On a measured device (`zaya shapes`) both are scaled by the factors `zaya.plan.calibrate` measured by
running the model. The operators are counted once by running a two-block and a one-block model of the same
family through forward and backward (`op_counts`): all of them, the library calls among them (GEMMs,
grouped GEMMs, attention, sorts, scatters: what a compiler calls rather than generates) and the ops that read
the device back (`.item()`, `nonzero`, `bincount`, ...). Eager, every operator is issued from the host;
compiled (`train.compile`), a block issues its library calls and about one fused kernel between each two, and
each of its graphs costs one call (a block is one graph, or with ep > 1 one per sublayer around the experts
and one for them; with cp > 1 its attention breaks where the exchanges run eagerly). The trainer reads the
device `HOST_READS_PER_STEP` times a step.

Overlap, as the code does it: FSDP2 prefetches the next block's all-gather and reduce-scatters the previous
block's gradients while a block computes, so FSDP and HSDP traffic is exposed only beyond the compute of the
micro-batches that carry it (all of them under full sharding; under ZeRO-2 the gathering comes with the
first micro-batch and the reduction with the last: one micro-batch's worth; ZeRO-1's gathering after the
update is exposed whole), plus one block's all-gather
before the first block and one reduce-scatter after the last; the ring
kernel's KV transfers overlap the attention of the blocks whose keys they carry, the all-gather kernel's do
not, nor does the halo of keys the sliding blocks exchange (`zaya.parallel.cp_window`); Muon's all-to-alls and
the trainer's all-reduces are exposed. Bandwidth per mesh dimension: the scale-up links if every group of
that dimension lies inside a node, the network (per GPU) otherwise.

Expert parallelism (`parallel.ep`): a rank's grouped GEMMs run E / ep experts of ~N ep / E rows each (the same
rows in all, in fewer, larger groups), in three calls per projection: the 1/ep of the rows that stay on the
rank, in two halves, and the rows received. Each of a layer's exchanges (dispatch and combine; in forward, in
the recomputed forward, and in backward) runs beside one half of the staying rows' GEMMs, their forward or in
backward their backward, and is exposed beyond them (`experts_exposed`; on a CPU the copies take the cores
that compute, and none is hidden); the received rows are put in expert order and back (a read and a write of
them each way); each MoE forward reads the exchange's split sizes back to the host (a sync per layer).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Protocol

from zaya.device import default_accelerator, launches_overlap_compute
from zaya.model.config import LAYER_TYPES, ZayaConfig
from zaya.model.flops import block_windows
from zaya.parallel.fsdp import (
    CONTEXT_PARALLEL_BREAKS,
    SUBLAYERS_AROUND_EXPERTS,
    collectives_per_step,
    gathers_per_micro_batch,
)
from zaya.plan.documents import DocumentPlan, attention_length, causal_pairs, document_pairs
from zaya.plan.inventory import config_key
from zaya.plan.layout import Layout
from zaya.plan.memory import GPU_DETAILS, DeviceDetails, activation_bytes, row_padding
from zaya.plan.traffic import DIMENSIONS, Traffic, window_halo
from zaya.train.stats import HOST_READS_PER_STEP

# ops whose output size or value the host must read back from the device
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::unique",
                      "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::masked_select",
                      "aten::item", "aten::is_nonzero"})
# ops a compiled graph still runs as kernels of their own (library calls, sorts, scatters), by name prefix
LIBRARY_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::convolution",
               "aten::_scaled_dot_product", "aten::sort", "aten::scatter", "aten::index_put", "aten::index_copy",
               "aten::gather", "aten::embedding", "aten::cumsum")


def reads_device(func, kwargs: dict) -> bool:
    """Whether the ATen op `func` (as a dispatch mode sees it, with its `kwargs`) makes the host read the device:
    one of `SYNC_OPS`, or `repeat_interleave` with tensor repeats (the `.Tensor` form, which the others call)
    and no `output_size`, which sizes its output from their sum."""
    name = func._schema.name
    return name in SYNC_OPS or (name == "aten::repeat_interleave" and func._overloadname == "Tensor"
                                and kwargs.get("output_size") is None)


SYNC_S = 20e-6  # one read's round trip from an accelerator (an assumption: 10-30 us on PCIe hosts)
GRAPH_CALL_S = 30e-6  # one call of a compiled graph: its guards and wrapper on the host (an assumption)

ADAMW_BYTES, MUON_BYTES, CLIP_BYTES = 28, 24, 8
LOSS_BYTES_PER_LOGIT = 16
ELEMENTWISE_PASSES = 4


class Rates(Protocol):
    """What the time model asks of a device (`zaya.plan.table.EfficiencyTable`, or `RooflineRates`)."""

    memory_bandwidth: float
    op_overhead_s: float

    def gemm_rate(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> float: ...

    def attention_rate(self, seq_len: int, head_dim: int, heads: int, kv_heads: int, **kwargs) -> float: ...


@dataclass(frozen=True)
class RooflineRates:
    """Rates of a published device: GEMMs at `gemm_efficiency` of the peak unless memory-bound; attention
    (flash kernels) at the same efficiency; elementwise work at `memory_efficiency` of the HBM bandwidth;
    `op_overhead_s` per kernel launch. The efficiencies are assumptions, stated in `zaya.plan.devices`."""

    peak_flops: dict[str, float]
    bandwidth: float
    gemm_efficiency: float
    memory_efficiency: float = 0.8
    op_overhead_s: float = 5e-6

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.peak_flops.items())), self.bandwidth, self.gemm_efficiency,
                     self.memory_efficiency, self.op_overhead_s))

    @property
    def memory_bandwidth(self) -> float:
        return self.bandwidth * self.memory_efficiency

    def gemm_rate(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> float:
        dtype = dtype or "bf16"
        peak = self.peak_flops.get(dtype, self.peak_flops["bf16"])
        element = 2 if dtype == "bf16" else 4
        flops = 2.0 * m * n * k
        weights = groups if op == "grouped" else 1
        moved = element * (m * k + weights * k * n + m * n)
        return min(peak * self.gemm_efficiency, flops / moved * self.memory_bandwidth)

    def attention_rate(self, seq_len: int, head_dim: int, heads: int, kv_heads: int, **kwargs) -> float:
        return self.peak_flops[kwargs.get("dtype") or "bf16"] * self.gemm_efficiency


@dataclass
class StepTime:
    """Seconds of one optimizer step by part (see the module docstring)."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    overhead: float = 0.0
    optimizer: float = 0.0
    comm_exposed: float = 0.0
    comm_by_dimension: dict[str, float] = field(default_factory=dict)

    @property
    def compute(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.overhead + self.optimizer

    @property
    def total(self) -> float:
        return self.compute + self.comm_exposed

    def scaled(self, factor: float) -> StepTime:
        """This step with its compute parts times `factor` (a calibration, `zaya.plan.calibration`); the exposed
        communication is the links', which a calibration does not measure apart, and stays as it is."""
        return StepTime(self.gemm * factor, self.attention * factor, self.elementwise * factor,
                        self.overhead * factor, self.optimizer * factor, self.comm_exposed,
                        dict(self.comm_by_dimension))

    def to_dict(self) -> dict[str, float]:
        return {"gemm": self.gemm, "attention": self.attention, "elementwise": self.elementwise,
                "overhead": self.overhead, "optimizer": self.optimizer, "comm_exposed": self.comm_exposed,
                "total": self.total}


def _dense(rates: Rates, m: float, n: int, k: int, dtype: str, backward: bool) -> float:
    """Seconds of one dense GEMM [m, k] x [k, n], and with `backward` its two gradient products."""
    m = max(1, int(m))
    seconds = 2.0 * m * n * k / rates.gemm_rate("dense", m, n, k, 1, dtype)
    if backward:
        seconds += 2.0 * m * n * k / rates.gemm_rate("dense", m, k, n, 1, dtype)  # dX = dY W
        seconds += 2.0 * m * n * k / rates.gemm_rate("dense", n, k, m, 1, dtype)  # dW = dY^T X
    return seconds


def _grouped(rates: Rates, m: float, n: int, k: int, groups: int, dtype: str, backward: bool) -> float:
    m = max(groups, int(m))
    seconds = 2.0 * m * n * k / rates.gemm_rate("grouped", m, n, k, groups, dtype)
    return seconds * (3 if backward else 1)


_BLOCK_GEMMS: dict[tuple, tuple[Rates, float]] = {}


def block_gemm_seconds(c: ZayaConfig, rates: Rates, tokens: int, precision: str, rho: float,
                       backward: bool = True, parts: str = "all", ep: int = 1) -> float:
    """One block's GEMMs for `tokens` tokens (`parts`: "all", "attention" or "moe"); with `ep` expert-parallel
    ranks the experts' GEMMs take the same rows over this rank's E / ep experts, in three calls (the module
    docstring). Remembered: the layouts of a search share their blocks' shapes (the rates object is kept with
    its answer, so that its id names it while the answer is kept)."""
    key = (config_key(c), id(rates), tokens, precision, rho, backward, parts, ep)
    known = _BLOCK_GEMMS.get(key)
    if known is not None and known[0] is rates:
        return known[1]
    if len(_BLOCK_GEMMS) > 1 << 14:
        _BLOCK_GEMMS.clear()
    seconds = _block_gemm_seconds(c, rates, tokens, precision, rho, backward, parts, ep)
    _BLOCK_GEMMS[key] = (rates, seconds)
    return seconds


def _block_gemm_seconds(c: ZayaConfig, rates: Rates, tokens: int, precision: str, rho: float, backward: bool,
                        parts: str, ep: int) -> float:
    a = precision
    D, Q, K, R = c.hidden_size, c.query_latent, c.key_latent, c.router_hidden_size
    E = c.num_experts // ep
    attention = _dense(rates, tokens, Q + 2 * K, D, a, backward) + _dense(rates, tokens, D, Q, a, backward) + \
        _dense(rates, tokens, Q + K, c.head_dim * (c.conv_padding + 1), a, backward)
    moe = (_dense(rates, tokens, R, D, "fp32", backward) + 2 * _dense(rates, tokens, R, R, "fp32", backward)
           + _dense(rates, tokens, c.num_experts + 1, R, "fp32", backward))  # the router scores every expert
    rows = tokens * rho
    if ep == 1:
        moe += _experts(c, rates, rows, E, a, backward)
    else:  # the staying rows in two halves, the received ones
        moe += 2 * _experts(c, rates, rows / ep / 2, E, a, backward) + _experts(c, rates, rows * (1 - 1 / ep), E, a,
                                                                               backward)
    return {"all": attention + moe, "attention": attention, "moe": moe}[parts]


def _experts(c: ZayaConfig, rates: Rates, rows: float, E: int, precision: str, backward: bool) -> float:
    """The experts' two grouped GEMMs (gate/up, down) over `rows` rows in `E` groups."""
    D, F_ = c.hidden_size, c.moe_intermediate_size
    return _grouped(rates, rows, 2 * F_, D, E, precision, backward) + _grouped(rates, rows, D, F_, E, precision,
                                                                              backward)


def experts_exposed(c: ZayaConfig, rates: Rates, layout: Layout, tokens: int, precision: str, rho: float,
                    micro_batches: int, seconds: float) -> float:
    """Of the token exchange's `seconds` in a step, what the staying rows do not hide: a layer's exchanges are
    alike (2 in forward, 2 more where the MoE is recomputed, 2 in backward), and each runs beside half the
    staying rows' expert GEMMs, their forward (dispatch, combine) or their backward (the gradients' two)."""
    if layout.ep == 1 or not seconds:
        return seconds
    forwards = 2 if layout.activation_checkpointing in ("moe", "full") else 1
    layers = micro_batches * c.num_hidden_layers
    each = seconds / (layers * (2 * forwards + 2))
    half = _experts(c, rates, tokens * rho / layout.ep / 2, c.num_experts // layout.ep, precision, False)
    return seconds - layers * (2 * forwards * min(each, half) + 2 * min(each, 2 * half))


def loss_gemm_seconds(c: ZayaConfig, rates: Rates, tokens: int, precision: str, details: DeviceDetails) -> float:
    """The fused loss's three products per chunk (logits, dL/dh, dL/dW), all in its forward."""
    V, D = c.vocab_size, c.hidden_size
    dtype = "fp32" if c.fp32_logits else precision
    rows = min(tokens, max(16, details.loss_chunk_logits // V))
    chunks = tokens / rows
    per_chunk = (2.0 * rows * V * D / rates.gemm_rate("dense", rows, V, D, 1, dtype)
                 + 2.0 * rows * V * D / rates.gemm_rate("dense", rows, D, V, 1, dtype)
                 + 2.0 * rows * V * D / rates.gemm_rate("dense", V, D, rows, 1, dtype))
    return chunks * per_chunk


def attention_seconds(c: ZayaConfig, rates: Rates, seq_len: int, sequences: int, cp: int, precision: str,
                      passes: float, documents: DocumentPlan | None = None, window: int | None = None) -> float:
    """Causal attention of one block over `sequences` sequences (this rank's 1/cp of the pairs), forward and
    backward (`passes` = 3: the backward costs two forwards; 4 with the forward recomputed); with `documents`,
    over packed documents kept apart, at the rate of attention of one document's length; with `window`, a
    sliding block's (its band's tiles, at the rate of attention of the window's length)."""
    pairs = causal_pairs(seq_len, window) if documents is None else document_pairs(seq_len, documents.tokens,
                                                                                    window)
    forward = 4.0 * c.num_attention_heads * c.head_dim * pairs * sequences / cp
    rate = rates.attention_rate(attention_length(seq_len, documents, window), c.head_dim, c.num_attention_heads,
                                c.num_key_value_heads, dtype=precision)
    return forward * passes / rate


@dataclass(frozen=True)
class OpCounts:
    """One forward + backward's operators: per block and outside the blocks (embedding, loss); all of them,
    the library calls among them, and the host reads."""

    per_block: float
    outside: float
    lib_calls_per_block: float
    lib_calls_outside: float
    syncs_per_block: float
    syncs_outside: float


@functools.lru_cache(maxsize=8)
def _op_counts(key: str) -> tuple[dict[str, tuple[int, int, int]], tuple[int, int, int]]:
    """(per block type: its (operators, library calls, host reads), outside the blocks: the same) of a small
    model with the same options (`key`: its config as JSON, `layer_types` the types it has, one of each): a
    model of one block of each type and the models with one block more of each type differ by that block
    (a block's type decides its attention, and the sliding blocks' own RoPE tables are formed outside)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from zaya.model.transformer import Zaya

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = self.lib_calls = self.syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            self.calls += 1
            self.lib_calls += name.startswith(LIBRARY_OPS)
            self.syncs += reads_device(func, kwargs or {})
            return func(*args, **(kwargs or {}))

    def count(types: list[str]) -> tuple[int, int, int]:
        config = ZayaConfig(**{**fields, "num_hidden_layers": len(types),
                               "layer_types": types if fields["layer_types"] is not None else None})
        torch.manual_seed(0)
        model = Zaya(config)
        ids = torch.randint(0, config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
        with Count() as counted:
            model.loss(ids[:, :-1], ids[:, 1:]).backward()
        return counted.calls, counted.lib_calls, counted.syncs

    fields = json.loads(key)
    base_types = fields["layer_types"] or ["hybrid"]
    if "hybrid_sliding" in base_types:  # once before counting: a band's plan is made once per process
        count(base_types)
    base = count(base_types)
    per_type = {kind: tuple(b - a for a, b in zip(base, count([*base_types, kind]), strict=True))
                for kind in base_types}
    outside = tuple(a - sum(counts[i] for counts in per_type.values()) for i, a in enumerate(base))
    return per_type, outside


_OP_COUNTS: dict[str, OpCounts] = {}


def op_counts(config: ZayaConfig) -> OpCounts:
    """The `OpCounts` of `_op_counts`, for a small model with `config`'s options, per block the mean over the
    config's blocks of their types' counts (remembered by the config's fields: a layout search asks for them
    tens of thousands of times)."""
    key = config_key(config)
    if key not in _OP_COUNTS:
        types = [kind for kind in LAYER_TYPES if config.layer_types is not None and kind in config.layer_types]
        small = {**config.to_dict(), "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 16, "num_experts": 2, "moe_intermediate_size": 32,
                 "router_hidden_size": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
                 "layer_types": types or None, "num_hidden_layers": len(types) or 1}
        if len(_OP_COUNTS) >= 16:
            _OP_COUNTS.clear()
        per_type, outside = _op_counts(json.dumps(small, sort_keys=True))
        L = config.num_hidden_layers
        mean = [sum(counts[i] * sum(config.layer_type(b) == kind for b in range(L)) for kind, counts in
                    per_type.items()) / L for i in range(3)]
        _OP_COUNTS[key] = OpCounts(float(mean[0]), float(outside[0]), float(mean[1]), float(outside[1]),
                                   float(mean[2]), float(outside[2]))
    return _OP_COUNTS[key]


def host_seconds(c: ZayaConfig, layout: Layout, micro_batches: int, op_overhead_s: float) -> tuple[float, float]:
    """(seconds the host spends issuing one step's kernels, host reads per step), eager or compiled blocks."""
    ops, L = op_counts(c), c.num_hidden_layers
    recomputed = {"none": 0.0, "moe": 0.25, "full": 0.5}[layout.activation_checkpointing] * L
    if layout.compiled:
        # a library call and about one fused kernel between each two; a block is a forward and a backward graph,
        # or with ep > 1 one of each per sublayer and one for the experts (`compile_around_experts`), and with
        # cp > 1 its attention breaks where the exchanges run eagerly; each graph a kernel more at its edge
        graphs = 1 if layout.ep == 1 else len(SUBLAYERS_AROUND_EXPERTS) + 1
        graphs += CONTEXT_PARALLEL_BREAKS if layout.cp > 1 else 0
        per_block = 2 * ops.lib_calls_per_block + graphs
        issued = micro_batches * (per_block * (L + recomputed) + ops.outside) * op_overhead_s
        issued += micro_batches * 2 * L * graphs * GRAPH_CALL_S
    else:
        issued = micro_batches * (ops.per_block * (L + recomputed) + ops.outside) * op_overhead_s
    reads = micro_batches * (ops.syncs_per_block * L + ops.syncs_outside) + HOST_READS_PER_STEP
    if layout.ep > 1:  # each MoE forward (again where recomputed) reads its exchange's split sizes
        reads += micro_batches * L * (2 if layout.activation_checkpointing in ("moe", "full") else 1)
    return issued, reads


def fsdp_copy_bytes(c: ZayaConfig, layout: Layout, precision: str, micro_batches: int = 1) -> float:
    """Bytes FSDP2 copies in one step, on one rank as on many: each all-gather copies the shards into its
    buffer and out into the unsharded parameters (read and write, twice), each reduce-scatter the unsharded
    gradients into its fp32 buffer and its output into the sharded gradients (three read-write passes); under
    ZeRO-2 each micro-batch after the first adds its gradients into the whole fp32 ones (reads both, writes
    the sum)."""
    from zaya.plan.inventory import inventory

    return _fsdp_copy_bytes(inventory(c), layout.shard_ranks, layout.ep, layout.sharding, precision, micro_batches)


@functools.lru_cache(maxsize=1024)
def _fsdp_copy_bytes(inv, shard_ranks: int, ep: int, sharding: str, precision: str, micro_batches: int) -> float:
    times = collectives_per_step(sharding, micro_batches)
    total = 0.0
    for unit in inv.sharded_units(ep):
        param_bytes = 2 if precision == "bf16" and not unit.keep_fp32 else 4
        gathers = gathers_per_micro_batch(unit, sharding, unit.shard_ranks(shard_ranks))
        total += times * (gathers * 4 * unit.numel * param_bytes + 6 * unit.numel * 4)
        if times < micro_batches:
            total += (micro_batches - times) * unit.numel * (param_bytes + 2 * 4)
    return total


def ep_copy_bytes(c: ZayaConfig, layout: Layout, tokens: int, precision: str, micro_batches: int) -> float:
    """Bytes expert parallelism copies in one step: the rows a rank receives put in expert order for its
    grouped GEMMs and their outputs back in arrival order (read and write each), in forward, in backward and
    in the MoE's recomputation; nothing with ep = 1, where the dispatch already groups the rows."""
    if layout.ep == 1:
        return 0.0
    passes = 3 if layout.activation_checkpointing in ("moe", "full") else 2
    vectors = 2 if precision == "bf16" else 4
    return micro_batches * c.num_hidden_layers * passes * 2 * 2 * tokens * c.hidden_size * vectors


def optimizer_seconds(c: ZayaConfig, rates: Rates, layout: Layout, ns_dtype: str, ns_steps: int,
                      factor: float = 1.0, gemms_only: bool = False) -> float:
    """Muon's Newton-Schulz on the matrices this rank owns (1/N of the work over every replica's ranks,
    balanced), its momentum and update, AdamW and clipping on this rank's shards, by the bytes they move x
    `factor` (measured on the device, `zaya.plan.calibrate`). `gemms_only`: Newton-Schulz alone."""
    from zaya.plan.inventory import inventory

    n = layout.shard_ranks
    dtype = "bf16" if ns_dtype in ("bfloat16", "bf16") else "fp32"
    inv = inventory(c)
    # the replicated parameters (the routers) are updated whole on every rank: as if on one
    sharded, replicated = (_optimizer_work(params, rates, dtype) for params in (inv.params, inv.replicated))
    seconds = ns_steps * (sharded[0] / (n * layout.dp_replicate) + replicated[0])
    if gemms_only:
        return seconds
    muon_elements, adamw_elements = sharded[1] / n + replicated[1], sharded[2] / n + replicated[2]
    moved = muon_elements * MUON_BYTES + adamw_elements * ADAMW_BYTES + (muon_elements + adamw_elements) * CLIP_BYTES
    return seconds + moved / rates.memory_bandwidth * factor


_OPTIMIZER_WORK: dict[tuple, tuple] = {}


def _optimizer_work(params, rates: Rates, dtype: str) -> tuple[float, int, int]:
    """(seconds of one Newton-Schulz iteration step over all of `params`' matrices, Muon elements, AdamW
    elements); remembered per parameter list and rates object, which a layout search asks about thousands
    of times."""
    try:
        key = (id(params), hash(rates), dtype)
    except TypeError:  # a measured table: by identity
        key = (id(params), id(rates), dtype)
    known = _OPTIMIZER_WORK.get(key)
    if known is not None and known[0] is params and known[1] == rates:
        return known[2]
    seconds, muon_elements, adamw_elements = 0.0, 0, 0
    for param in params:
        if param.muon:
            count = param.shape[0] if len(param.shape) == 3 else 1
            rows, cols = param.shape[-2:]
            k, m = min(rows, cols), max(rows, cols)
            # per step: X X^T [k, m] x [m, k], A^2 [k, k] x [k, k], (bA + cA^2) X [k, k] x [k, m]
            seconds += count * (2.0 * k * k * m / rates.gemm_rate("dense", k, k, m, 1, dtype)
                                + 2.0 * k ** 3 / rates.gemm_rate("dense", k, k, k, 1, dtype)
                                + 2.0 * k * k * m / rates.gemm_rate("dense", k, m, k, 1, dtype))
            muon_elements += param.numel
        else:
            adamw_elements += param.numel
    if len(_OPTIMIZER_WORK) > 64:
        _OPTIMIZER_WORK.clear()
    _OPTIMIZER_WORK[key] = (params, rates, (seconds, muon_elements, adamw_elements))
    return seconds, muon_elements, adamw_elements


def step_time(c: ZayaConfig, layout: Layout, seq_len: int, precision: str, micro_batches: int, rates: Rates,
              traffic: Traffic, bandwidths: dict[str, float], ns_dtype: str = "bfloat16", ns_steps: int = 5,
              cp_kernel: str = "allgather", details: DeviceDetails = GPU_DETAILS,
              documents: DocumentPlan | None = None, cp_chunks: int = 2) -> StepTime:
    """The `StepTime` of one optimizer step of rank 0; `bandwidths` are bytes/s per mesh dimension; `documents`:
    the packed documents a phase keeps apart (None: causal attention over whole rows); `cp_chunks`: the chunks
    per rank of a split sequence."""
    mode = layout.activation_checkpointing
    tokens = layout.micro_batch_size * seq_len // layout.cp
    ep = layout.ep
    rho = row_padding(c, tokens, details, ep)
    L = c.num_hidden_layers
    time = StepTime()
    blocks = L * block_gemm_seconds(c, rates, tokens, precision, rho, ep=ep)
    recomputed = {"none": 0.0, "moe": L * block_gemm_seconds(c, rates, tokens, precision, rho, False, "moe", ep),
                  "full": L * block_gemm_seconds(c, rates, tokens, precision, rho, False, ep=ep)}[mode]
    loss = loss_gemm_seconds(c, rates, tokens, precision, details)
    time.gemm = micro_batches * (blocks + recomputed + loss)
    passes = 4 if mode == "full" else 3
    attention = {window: blocks * micro_batches * attention_seconds(
        c, rates, seq_len, layout.micro_batch_size, layout.cp, precision, passes, documents, window)
        for window, blocks in block_windows(c).items()}
    time.attention = sum(attention.values())
    # a recomputed region repeats its forward's share (about a third) of its elementwise work
    recompute = {"none": 1.0, "moe": 1 + 0.5 / 3, "full": 1 + 1 / 3}[mode]
    saved, _ = activation_bytes(c, tokens, seq_len, layout.cp, precision, "none", details, ep, documents is not None,
                                cp_chunks)
    saved -= c.vocab_size * c.hidden_size * 4  # the loss's dW: written once, counted with the loss
    moved = ELEMENTWISE_PASSES * saved * recompute + LOSS_BYTES_PER_LOGIT * tokens * c.vocab_size
    # measured on the device: how much slower than the bytes say (`zaya.plan.calibrate`)
    seconds = moved / rates.memory_bandwidth * (getattr(rates, "elementwise_factor", 0.0) or 1.0)
    time.elementwise = micro_batches * seconds + (fsdp_copy_bytes(c, layout, precision, micro_batches)
                                                  + ep_copy_bytes(c, layout, tokens, precision, micro_batches)) \
        / rates.memory_bandwidth
    issued, reads = host_seconds(c, layout, micro_batches, rates.op_overhead_s)
    device_type = (getattr(rates, "device", None) or default_accelerator().type).split(":")[0]
    if launches_overlap_compute(device_type):
        issued = max(0.0, issued - (time.gemm + time.attention + time.elementwise))
        issued += reads * (SYNC_S + rates.op_overhead_s)
    time.overhead = issued
    time.optimizer = optimizer_seconds(c, rates, layout, ns_dtype, ns_steps,
                                       getattr(rates, "optimizer_factor", 0.0) or 1.0)
    time.comm_by_dimension = {dim: 0.0 for dim in DIMENSIONS}
    seconds: dict[str, float] = {}
    for (kind, dim), nbytes in traffic.entries.items():
        seconds[kind] = seconds.get(kind, 0.0) + nbytes / bandwidths[dim]
        time.comm_by_dimension[dim] += nbytes / bandwidths[dim]
    fsdp = sum(v for k, v in seconds.items() if k.startswith("fsdp_"))
    block_compute = time.gemm + time.attention + time.elementwise
    edges = 2 * fsdp / max(1, 2 * L + 1)  # one block's gathering before the first, its reduction after the last
    carrying = block_compute * collectives_per_step(layout.sharding, micro_batches) / micro_batches
    # ZeRO-1 gathers after the update, with nothing to hide behind
    after_update = seconds.get("fsdp_all_gather", 0.0) if layout.sharding == "zero1" else 0.0
    exposed = max(0.0, fsdp - after_update - carrying) + after_update + edges if fsdp else 0.0
    # the ring kernel's transfers hide behind the attention of the blocks whose keys travel whole; the sliding
    # blocks' halo (`cp_window_*`) is exchanged before their attention, and waited for
    cp = sum(v for k, v in seconds.items() if k.startswith("cp_") and not k.startswith("cp_window"))
    halo = window_halo(c, seq_len, layout.cp, cp_chunks)
    hiding = sum(t for window, t in attention.items() if window is None or halo is None)
    exposed += cp if cp_kernel == "allgather" else max(0.0, cp - hiding)
    exposed += sum(v for k, v in seconds.items() if k.startswith("cp_window"))
    exposed += sum(v for k, v in seconds.items() if k.startswith("muon_") or k in ("trainer", "replicated"))
    experts = seconds.get("experts", 0.0)  # hidden only where the staying rows' GEMMs run beside it
    hides = launches_overlap_compute(device_type)  # on a CPU the same cores copy and compute
    exposed += experts_exposed(c, rates, layout, tokens, precision, rho, micro_batches, experts) if hides else experts
    time.comm_exposed = exposed
    return time
