"""Dropless top-1 Mixture of Experts with SwiGLU experts stored stacked (spec section 5.2).

    Expert_e(x) = W_down,e ( SiLU(W_gate,e x) * (W_up,e x) ),   gate_up_proj[e] = [W_gate,e ; W_up,e]
    m = g * Expert_{i*}(x)                  if i* < E
    m = 0  (native)  or  g * x  (legacy)    if i* = E, the skip route

Dispatch sorts the tokens by expert and runs each projection as one grouped matmul over contiguous row
ranges (`torch._grouped_mm` where it exists, else one padded batched matmul), so no Python loop issues a
matmul per expert. Where the device module asks for it (CPU, half precision) each range is padded with zero
rows to a fixed multiple, so that the per-group GEMM shapes recur; only then, and only eagerly, does anything
wait on the host. The whole dispatch compiles into one graph (`torch.compile(fullgraph=True)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import library as torch_ops
from torch import nn

from zaya.device import autocast_dtype, grouped_mm_pays_for_empty_groups, grouped_mm_row_multiple
from zaya.model.config import ZayaConfig
from zaya.model.router import Routing, ZayaRouter

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp64 (exactness tests) takes the fallback


class Experts(nn.Module):
    """E SwiGLU experts as two stacked tensors: `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]."""

    def __init__(self, config: ZayaConfig):
        super().__init__()
        E, F_, D = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))
        self.use_grouped_mm = HAS_GROUPED_MM

    def forward(self, x_ND: torch.Tensor, route_N: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
        """weight * Expert_{route}(x) for every token, `route` in 0..E, E the skip route, where the caller gave the
        weight 0 (None: no weight, 1). Skipped tokens ride along with the last expert: it keeps the dispatch free
        of host syncs, and the skip route is (by its bias of -1) practically never taken."""
        expert_N = route_N.clamp(max=self.num_experts - 1)
        if x_ND.shape[0] < self.num_experts and grouped_mm_pays_for_empty_groups(x_ND.device):
            if x_ND.shape[0] == 1:
                return self._single(x_ND, expert_N, weight_N)
            return self.gathered(x_ND, expert_N, weight_N)
        return _weighted(self.grouped(x_ND, expert_N), weight_N)

    def grouped(self, x_ND: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
        """Expert_{expert}(x) for every token, `expert` in 0..E-1, through the grouped matmuls (for any number
        of tokens; nothing here waits on the host in a compiled graph)."""
        # cast before dispatching: under autocast the experts run in bf16, and half the bytes move
        x_ND = x_ND.to(autocast_dtype(x_ND.device) or x_ND.dtype)
        multiple = grouped_mm_row_multiple(x_ND.device, x_ND.dtype)
        row_N, sizes_E, rows = _group_rows(expert_N, self.num_experts, multiple)
        x_grouped = _to_rows(x_ND, row_N, rows)
        matmul = _grouped_matmul if self.use_grouped_mm and x_ND.dtype in GROUPED_MM_DTYPES else _padded_matmul
        h = matmul(x_grouped, self.gate_up_proj, sizes_E)
        gate, up = h.chunk(2, dim=-1)
        y_grouped = matmul(F.silu(gate) * up, self.down_proj, sizes_E)
        return _from_rows(y_grouped, row_N)

    def gathered(self, x_ND: torch.Tensor, route_N: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
        """The same for few tokens (decoding): each token's expert weights gathered, one batched matmul per
        projection, and no host sync (the compiled decode step uses it as it is)."""
        expert_N = route_N.clamp(max=self.num_experts - 1)
        x = x_ND[:, :, None]
        gate_up = self.gate_up_proj.index_select(0, expert_N)
        x, gate_up = _autocast_operands(x, gate_up)
        gate, up = torch.bmm(gate_up, x).chunk(2, dim=1)
        down = self.down_proj.index_select(0, expert_N).to(x.dtype)
        y = torch.bmm(down, F.silu(gate) * up).squeeze(-1)
        return _weighted(y, weight_N)

    def _single(self, x_ND: torch.Tensor, expert_N: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
        """One token, one expert: its weights read in place (the index is in host memory on the CPU)."""
        e = int(expert_N[0])
        x, gate_up = _autocast_operands(x_ND, self.gate_up_proj[e])
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, self.down_proj[e].to(x.dtype))
        return _weighted(y, weight_N)


def _weighted(y_ND: torch.Tensor, weight_N: torch.Tensor | None) -> torch.Tensor:
    return y_ND if weight_N is None else y_ND * weight_N[:, None].to(y_ND.dtype)


class ZayaMoE(nn.Module):
    """Router + experts. The skip route computes nothing; its output follows `config.skip_route`."""

    def __init__(self, config: ZayaConfig, use_eda: bool):
        super().__init__()
        self.num_experts = config.num_experts
        self.skip_identity = config.skip_route == "identity"
        self.router = ZayaRouter(config, use_eda)
        self.experts = Experts(config)

    def forward(
        self, x_BTD: torch.Tensor, prev_router_state: torch.Tensor | None, *, gathered: bool = False
    ) -> tuple[torch.Tensor, Routing]:
        """MoE output [B, T, D] and the routing; `gathered` always takes `Experts.gathered` (decoding)."""
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D)
        routing = self.router(x, prev_router_state)
        skipped = routing.route == self.num_experts
        weight = routing.gate.masked_fill(skipped, 0.0)
        experts = self.experts.gathered if gathered else self.experts
        out = experts(x, routing.route, weight)
        if self.skip_identity:
            out = out + ((routing.gate * skipped)[:, None] * x).to(out.dtype)
        return out.view(B, T, D), routing


# ---- dispatch primitives ------------------------------------------------------------------------------


def expert_counts(expert_N: torch.Tensor, E: int) -> torch.Tensor:
    """Tokens per expert [E], on the device: a scatter-add, where `bincount` reads the ids' range back to the
    host on accelerators (a blocking sync per MoE layer)."""
    return torch.zeros(E, dtype=torch.long, device=expert_N.device).scatter_add_(0, expert_N,
                                                                                torch.ones_like(expert_N))


def _group_rows(expert_N: torch.Tensor, E: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The grouped layout: each expert's tokens on contiguous rows, in token order, expert 0 first, every
    group padded with zero rows to a multiple of `multiple`. Returns each token's row, the group sizes [E]
    and the number of rows.

    With padding (only the CPU asks for it) the number of rows depends on the counts: eagerly it is read back
    to the host; a compiled graph cannot read it and takes the bound N + E (multiple - 1) instead, rounded up to
    a multiple, the last group taking the slack, so the graph's shapes depend on N alone."""
    N = expert_N.shape[0]
    counts = expert_counts(expert_N, E)
    order = torch.argsort(expert_N, stable=True)
    sizes = counts if multiple == 1 else (counts + multiple - 1) // multiple * multiple
    pad = sizes - counts
    shift = torch.cumsum(pad, 0) - pad  # pad rows before each group
    expert_sorted = expert_N[order]
    row_N = torch.empty_like(order)
    row_N[order] = torch.arange(N, device=order.device) + shift[expert_sorted]
    if multiple == 1:
        return row_N, sizes, N
    if torch.compiler.is_compiling():
        rows = -(-(N + E * (multiple - 1)) // multiple) * multiple
        sizes = torch.cat([sizes[:-1], (rows - sizes[:-1].sum()).view(1)])
        return row_N, sizes, rows
    return row_N, sizes, int(sizes.sum())


class _ToRows(torch.autograd.Function):
    """out[row[i]] = x[i] in a zero buffer of `rows` rows; the backward gathers (row is injective)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(row)
        return _scatter_rows(x, row, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (row,) = ctx.saved_tensors
        return grad.index_select(0, row), None, None


class _FromRows(torch.autograd.Function):
    """y[row[i]] for every token i; the backward scatters into a zero buffer (row is injective)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row)
        ctx.rows = y.shape[0]
        return y.index_select(0, row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (row,) = ctx.saved_tensors
        return _scatter_rows(grad.contiguous(), row, ctx.rows), None


def _scatter_rows(x: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    # with as many rows as tokens, row is a permutation: all are written, and no zeros are needed. In a graph
    # whose token count is a size it cannot know (expert parallelism's received rows) and padded groups, that
    # equality may be undecidable: then the zeros
    whole = rows == x.shape[0]
    if torch.compiler.is_compiling():
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        whole = statically_known_true(whole)
    out = x.new_empty(rows, x.shape[1]) if whole else x.new_zeros(rows, x.shape[1])
    return out.index_copy_(0, row, x)


def _to_rows(x: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    return _ToRows.apply(x, row, rows)


def _from_rows(y: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return _FromRows.apply(y, row)


class _GroupedMM(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e]^T over contiguous row groups, forward and backward grouped."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_EMK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_NK, w_EMK, offsets)
        return _grouped_mm(x_NK, w_EMK.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor):
        x_NK, w_EMK, offsets = ctx.saved_tensors
        grad_NM = grad_NM.contiguous()  # the kernel rejects broadcast (zero-stride) gradients
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _grouped_mm(grad_NM, w_EMK, offsets)
        if ctx.needs_input_grad[1]:
            # per group: dW_e = dY_e^T X_e, a grouped matmul whose groups split the shared (token) dimension
            grad_w = _grouped_mm(grad_NM.t(), x_NK, offsets)
        return grad_x, grad_w, None


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # The compiler's shape function for `torch._grouped_mm` takes bf16 only, while the kernels also take fp32
    # and fp16: in a compiled graph those run through `zaya::grouped_mm`, the same kernel behind a shape function
    # of its own.
    if a.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
        return torch._grouped_mm(a, b, offs=offsets)
    return grouped_mm_op(a, b, offsets)


if HAS_GROUPED_MM:
    @torch_ops.custom_op("zaya::grouped_mm", mutates_args=())
    def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """`torch._grouped_mm(a, b, offs=offsets)`, opaque to the compiler."""
        return torch._grouped_mm(a, b, offs=offsets)

    @grouped_mm_op.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if a.dim() == 2 and b.dim() == 3:  # rows grouped: [N, K] x [E, K, M] -> [N, M]
            return a.new_empty(a.shape[0], b.shape[-1])
        # the shared dimension grouped: [M, N] x [N, K] -> [E, M, K]
        return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])


def _autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Autocast does not cover grouped matmuls: cast as it would cast an nn.Linear.
    dtype = autocast_dtype(x.device)
    if dtype is not None:
        return x.to(dtype), w.to(dtype)
    return x, w.to(x.dtype)


def _grouped_matmul(x_NK: torch.Tensor, w_EMK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    x_NK, w_EMK = _autocast_operands(x_NK, w_EMK)
    offsets = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return _GroupedMM.apply(x_NK, w_EMK, offsets)


def _padded_matmul(x_NK: torch.Tensor, w_EMK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Fallback without `torch._grouped_mm`: scatter the sorted rows into [E, capacity, K], one bmm, gather back."""
    x_NK, w_EMK = _autocast_operands(x_NK, w_EMK)
    E, N = counts_E.numel(), x_NK.shape[0]
    starts = torch.cumsum(counts_E, 0) - counts_E
    expert = torch.repeat_interleave(torch.arange(E, device=x_NK.device), counts_E, output_size=N)
    slot = torch.arange(N, device=x_NK.device) - starts[expert]
    capacity = int(counts_E.max()) if N else 0
    padded = x_NK.new_zeros(E, capacity, x_NK.shape[1])
    padded = padded.index_put((expert, slot), x_NK)
    out = torch.bmm(padded, w_EMK.transpose(-2, -1))
    return out[expert, slot]
