"""Muon for the matrices of the model: momentum, then an update orthogonalised by Newton-Schulz.

For a matrix parameter W [m, n] with gradient g, step t (the semantics of `torch.optim.Muon`):

    B_t = mu B_{t-1} + (1 - mu) g_t                         momentum, kept as an EMA (B_0 = 0)
    U_t = (1 - mu) g_t + mu B_t   if nesterov,  else B_t
    O_t = NS_k(U_t)                                         quintic Newton-Schulz, k = 5 steps
    W_t = (1 - lr lambda) W_{t-1} - lr s(m, n) O_t          decoupled weight decay, update-RMS rule s

    s(m, n) = sqrt(max(1, m / n))          "original" (Keller Jordan's Muon)
    s(m, n) = 0.2 sqrt(max(m, n))          "match_rms_adamw" (Moonshot): the update's RMS matches AdamW's,
                                            so one learning rate and schedule serve both optimizers

NS_k(U): X_0 = U / max(||U||_F, eps), then k times, with (a, b, c) = (3.4445, -4.7750, 2.0315),

    A = X X^T,   X <- a X + (b A + c A^2) X

which pushes every singular value of X_0 into roughly [0.7, 1.2] (the quintic's band: it trades exact
convergence to 1 for a steep slope at 0). A tall matrix (m > n) iterates on its transpose, so that A is the
smaller Gram matrix, without copying it: A = X^T X and X <- a X + X (b A + c A^2).

Batching. A ZAYA1-size MoE has thousands of matrices of a handful of shapes (every expert of every layer
has the same two), and the iteration of one small matrix cannot occupy a machine. Here the matrices of one
shape, across layers, experts and parameter groups, are normalised into one [B, m, n] stack, and each step
of the iteration is three batched matmuls (`bmm`, `baddbmm`) over the whole stack; a stacked expert
parameter [E, m, n] contributes its E matrices. A batch streams through in chunks (written, iterated and
applied chunk by chunk; see CPU_CHUNK_BYTES). The iteration runs in bf16 (the matmuls accumulate in fp32) or,
on request, in fp32; `backend="compiled"` runs it through `torch.compile`, as "auto" does on GPUs.

Symmetry. A and b A + c A^2 are symmetric, so their lower block triangle need not be computed. On the CPU,
from a Gram side of 512 on (`zaya.device.newton_schulz_blocks_from`), the eager iteration splits X into
halves along the Gram side and forms only the blocks A11, A12, A22 and the same three of b A + c A^2
(`_quintic_blocks`): 3/4 of those products' FLOPs, 15-17% of the iteration's. It pays only when every block
of the batch is its own contiguous tensor (`bmm` copies a strided one on every call): measured on a 2-core
Zen 5 with oneDNN's bf16 GEMMs, 5-11% faster for 512-wide matrices, and no faster at 256, where half-size
GEMMs lose what the FLOPs save. In bf16 its extra roundings (the blocks are sums of two products) move the
output by ~1.6% against a float64 iteration instead of ~1.1%. Iterating on the Gram matrix alone
(X_t = Q_t X_0) saves 16% of the FLOPs for 1:2 matrices but drifts by 10-25% in bf16, so it is not used.

The math lives in functions on full local matrices (`newton_schulz`, `orthogonalize`, `muon_update`), so
that a sharded optimizer can gather a matrix on the rank that owns it and call them there. `Muon` itself
accepts `DTensor` parameters: a stack of experts sharded along the expert dimension is orthogonalised shard
by shard without communication (each shard holds whole matrices); any other sharded matrix is gathered with
`full_tensor()`, orthogonalised redundantly on every rank, and sliced back to the local shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from zaya.device import batched_matmul_multiple, newton_schulz_blocks_from
from zaya.errors import ZayaError

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # a torch build without torch.distributed: parameters are never DTensors
    DTensor = None

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_BACKENDS = ("auto", "eager", "compiled")

# A batch streams through the iteration in chunks: each chunk of matrices is written (momentum, direction,
# normalisation), iterated and consumed (weight decay, update) before the next, so the scratch memory is one
# chunk's. On a GPU a chunk is MAX_BATCH_NUMEL elements of X. On the CPU it is sized so that its four
# operands (X, its successor and two Gram matrices) fit in the last-level cache and every pass over it finds
# its inputs there: measured, 16 MB chunks iterate 512 x 1024 matrices 5-15% faster than whole batches, and
# 256 x 256 ones as fast, and a whole-batch pass would stream the elementwise work from memory.
MAX_BATCH_NUMEL = 1 << 28
CPU_CHUNK_BYTES = 16 << 20
# The block iteration (see _quintic_blocks) multiplies half-size matrices, and more of them per call pays:
# measured, 24-32 MB chunks iterate 512-wide Gram matrices 4-6% faster than 16 MB ones.
CPU_BLOCKS_CHUNK_BYTES = 32 << 20
# Within a chunk, the fp32 elementwise work goes a few matrices at a time on the CPU, for the same reason.
CPU_SLICE_BYTES = 4 << 20


# ---- Newton-Schulz on full local matrices ---------------------------------------------------------------


def newton_schulz(
    G: Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> Tensor:
    """Orthogonalise one matrix [m, n], or every matrix of a batch [B, m, n] on its own.

    Each matrix is divided by max(its Frobenius norm, `eps`) and rounded to `dtype`, then `steps` quintic
    iterations run batched over B. Returns a tensor of `G`'s shape in `dtype`; an all-zero matrix gives zeros.
    `backend` is "eager", "compiled" (`torch.compile`) or "auto" (compiled on GPUs, eager elsewhere).
    """
    _check_ns_settings(steps, coefficients, eps, backend)
    if G.ndim not in (2, 3):
        raise ZayaError(f"newton_schulz: expected a matrix [m, n] or a batch [B, m, n], got shape {list(G.shape)}")
    return orthogonalize([G], steps, coefficients, eps, dtype, backend=backend)[0]


def orthogonalize(
    matrices: Sequence[Tensor],
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> list[Tensor]:
    """`newton_schulz` of every tensor of `matrices`, each a matrix [m, n] or a stack [E, m, n] of E
    matrices, with one batched iteration per distinct (m, n) rather than one per matrix.

    Returns a new tensor per input, of its shape, in `dtype`.
    """
    _check_ns_settings(steps, coefficients, eps, backend)
    return _run_batches([_Normalized(m) for m in matrices], "orthogonalize", steps, coefficients, eps, dtype, backend)


def muon_update(
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> list[Tensor]:
    """Muon's update directions for full local matrices (each [m, n] or a stack [E, m, n]): the momentum
    B <- lerp(B, g, 1 - mu), in place, then O = NS(U) with U = lerp(g, B, mu) (Nesterov) or B, batched by shape.

    Returns O per input, of its shape, in `dtype`; the caller applies W <- (1 - lr wd) W - lr s(m, n) O
    (`adjusted_lr`). This is the part of a Muon step that needs whole matrices, for an optimizer that
    gathers them on the rank that owns them.
    """
    _check_ns_settings(steps, coefficients, eps, backend)
    if len(grads) != len(momentum_buffers):
        raise ZayaError(f"muon_update: {len(grads)} gradients but {len(momentum_buffers)} momentum buffers")
    directions = [_Direction(g, b, momentum, nesterov) for g, b in zip(grads, momentum_buffers, strict=True)]
    return _run_batches(directions, "muon_update", steps, coefficients, eps, dtype, backend)


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of `steps` iterations on one [rows, cols] matrix: with k = min, l = max of the two,
    each step costs 2 k^2 l (A = X X^T) + 2 k^3 (A^2) + 2 k^2 l ((bA + cA^2) X)."""
    k, l = min(rows, cols), max(rows, cols)
    return steps * (4 * k * k * l + 2 * k**3)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The learning rate of a [rows, cols] matrix under the update-RMS rule `adjust_lr_fn` (None: "original")."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ZayaError(f"Muon: 'adjust_lr_fn' must be one of {', '.join(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")
    return lr * ratio


# ---- the iteration --------------------------------------------------------------------------------------


def _normalize_into(G_BMN: Tensor, out_BMN: Tensor, eps: float, *, overwrite: bool = False) -> None:
    """out = G / max(||G||_F, eps) per matrix, computed in at least fp32 and rounded once into out's dtype;
    `overwrite` lets G be scaled in place on the way."""
    norm = torch.linalg.vector_norm(
        G_BMN, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(G_BMN.dtype, torch.float32)
    ).clamp_min_(eps)
    if overwrite and G_BMN.dtype == norm.dtype != out_BMN.dtype:
        out_BMN.copy_(G_BMN.div_(norm))  # on the CPU, two single-dtype passes beat one mixed-dtype pass
    else:
        torch.div(G_BMN, norm, out=out_BMN)


def _compiled(backend: str, device: torch.device) -> bool:
    return backend == "compiled" or (backend == "auto" and device.type == "cuda")


def _chunk_size(rows: int, cols: int, total: int, dtype: torch.dtype, device: torch.device, compiled: bool) -> int:
    """Matrices per chunk of a batch of `total` [rows, cols] matrices: at most a budget's worth (see
    MAX_BATCH_NUMEL and CPU_CHUNK_BYTES), then evened out (`_balanced`)."""
    if device.type == "cpu" and not compiled:
        k = min(rows, cols)
        budget = CPU_BLOCKS_CHUNK_BYTES if _takes_blocks(k, device) else CPU_CHUNK_BYTES
        per = max(1, budget // max(1, (2 * rows * cols + 2 * k * k) * dtype.itemsize))
    else:
        per = max(1, MAX_BATCH_NUMEL // max(1, rows * cols))  # empty matrices: any count
    return _balanced(total, per, device)


def _balanced(total: int, per: int, device: torch.device) -> int:
    """A chunk size for `total` matrices that needs no more chunks than chunks of `per` would, with the
    chunks of (nearly) equal size, rounded up to a multiple of `batched_matmul_multiple` where they exceed
    it: 32 matrices at 21 per chunk go as 16 + 16, not as 21 + 11, whose odd batches leave a thread idle."""
    if total <= per:
        return max(1, total)
    size = -(-total // -(-total // per))
    multiple = batched_matmul_multiple(device)
    return -(-size // multiple) * multiple if size > multiple else size


class _Buffers:
    """Scratch of the eager iteration for chunks of up to `like.shape[0]` matrices: the two Gram-sized
    matrices A and b A + c A^2, and the successor of X."""

    def __init__(self, workspace: Workspace, like: Tensor) -> None:
        count, m, n = like.shape
        gram = (count, min(m, n), min(m, n))
        self.A = workspace.take("A", gram, like.dtype, like.device)
        self.P = workspace.take("P", gram, like.dtype, like.device)
        self.Y = workspace.take("Y", like.shape, like.dtype, like.device)


def _quintic_eager(X: Tensor, steps: int, a: float, b: float, c: float, buffers: _Buffers) -> Tensor:
    """The iteration on preallocated buffers: three batched matmuls per step and no other kernel (or, on
    Gram sides where the device module asks for it, the block-symmetric form of `_quintic_blocks`)."""
    count = X.shape[0]
    A, P, Y = buffers.A[:count], buffers.P[:count], buffers.Y[:count]
    if _takes_blocks(min(X.shape[-2:]), X.device):
        return _quintic_blocks(X, Y, A, P, steps, a, b, c)
    tall = X.shape[-2] > X.shape[-1]
    for _ in range(steps):
        if tall:
            torch.bmm(X.mT, X, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)  # b A + c A^2
            torch.baddbmm(X, X, P, beta=a, out=Y)  # a X + X (b A + c A^2)
        else:
            torch.bmm(X, X.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=P)
            torch.baddbmm(X, P, X, beta=a, out=Y)  # a X + (b A + c A^2) X
        X, Y = Y, X
    return X


def _takes_blocks(k: int, device: torch.device) -> bool:
    """Whether the eager iteration on a Gram side of `k` goes by 2 x 2 blocks (`_quintic_blocks`)."""
    blocks_from = newton_schulz_blocks_from(device)
    return blocks_from is not None and k >= blocks_from and k % 2 == 0


def _quintic_blocks(X: Tensor, Y: Tensor, A: Tensor, P: Tensor, steps: int, a: float, b: float, c: float) -> Tensor:
    """The same iteration on 2 x 2 blocks of the (symmetric) Gram matrices: A = [[A11, A12], [A12^T, A22]]
    and P = b A + c A^2 likewise, so only A11, A12, A22 and P11, P12, P22 are formed:

        P11 = b A11 + c (A11 A11 + A12 A12^T)    P12 = b A12 + c (A11 A12 + A12 A22)
        P22 = b A22 + c (A12^T A12 + A22 A22)

    X is split into halves along the Gram side (rows if wide, columns if tall), and each half of the batch is
    stored as one contiguous tensor: a strided block of a batch is copied by `bmm` on every call. The halves
    live in X's and Y's memory (X is copied out first) and the blocks in A's and P's; the result is copied
    back to the [count, m, n] layout in whichever of X and Y does not hold it, and returned."""
    count, m, n = X.shape
    tall = m > n
    h = min(m, n) // 2
    half = (count, m, h) if tall else (count, h, n)

    def halves(buffer: Tensor) -> Tensor:
        return buffer.view(-1)[: 2 * math.prod(half)].view(2, *half)

    def as_halves(matrices: Tensor) -> Tensor:  # [count, m, n] viewed as its two halves [2, *half]
        if tall:
            return matrices.view(count, m, 2, h).permute(2, 0, 1, 3)
        return matrices.view(count, 2, h, n).transpose(0, 1)

    current, following = halves(Y), halves(X)
    current.copy_(as_halves(X))
    A11, A12, A22 = A.view(-1)[: 3 * count * h * h].view(3, count, h, h).unbind(0)
    P11, P12, P22 = P.view(-1)[: 3 * count * h * h].view(3, count, h, h).unbind(0)
    for _ in range(steps):
        (X1, X2), (Y1, Y2) = current.unbind(0), following.unbind(0)
        if tall:  # A = X^T X
            torch.bmm(X1.mT, X1, out=A11)
            torch.bmm(X1.mT, X2, out=A12)
            torch.bmm(X2.mT, X2, out=A22)
        else:  # A = X X^T
            torch.bmm(X1, X1.mT, out=A11)
            torch.bmm(X1, X2.mT, out=A12)
            torch.bmm(X2, X2.mT, out=A22)
        torch.baddbmm(A11, A11, A11, beta=b, alpha=c, out=P11).baddbmm_(A12, A12.mT, alpha=c)
        torch.baddbmm(A12, A11, A12, beta=b, alpha=c, out=P12).baddbmm_(A12, A22, alpha=c)
        torch.baddbmm(A22, A22, A22, beta=b, alpha=c, out=P22).baddbmm_(A12.mT, A12, alpha=c)
        if tall:  # Y = a X + X P:  Y1 = a X1 + X1 P11 + X2 P12^T,  Y2 = a X2 + X1 P12 + X2 P22
            torch.baddbmm(X1, X1, P11, beta=a, out=Y1).baddbmm_(X2, P12.mT)
            torch.baddbmm(X2, X1, P12, beta=a, out=Y2).baddbmm_(X2, P22)
        else:  # Y = a X + P X:  Y1 = a X1 + P11 X1 + P12 X2,  Y2 = a X2 + P12^T X1 + P22 X2
            torch.baddbmm(X1, P11, X1, beta=a, out=Y1).baddbmm_(P12, X2)
            torch.baddbmm(X2, P12.mT, X1, beta=a, out=Y2).baddbmm_(P22, X2)
        current, following = following, current
    out = X if current.data_ptr() == Y.data_ptr() else Y
    as_halves(out).copy_(current)
    return out


def _quintic(X: Tensor, steps: int, a: float, b: float, c: float) -> Tensor:
    """The same iteration written functionally, the form `torch.compile` takes."""
    tall = X.shape[-2] > X.shape[-1]
    for _ in range(steps):
        if tall:
            A = X.mT @ X
            X = torch.baddbmm(X, X, torch.baddbmm(A, A, A, beta=b, alpha=c), beta=a)
        else:
            A = X @ X.mT
            X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X


@functools.cache
def _compiled_quintic() -> Callable[..., Tensor]:
    # Built on first use, so that importing the optimizer does not start the compiler; dynamic shapes, so
    # that one graph per orientation serves every batch size and matrix shape.
    return torch.compile(_quintic, dynamic=True)


def _check_ns_settings(steps: Any, coefficients: Any, eps: Any, backend: Any, where: str = "newton_schulz") -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps < 100:
        raise ZayaError(f"{where}: 'ns_steps' must be an integer in 1..99, got {steps!r}")
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or not all(map(_finite, coefficients)):
        raise ZayaError(f"{where}: 'ns_coefficients' must be three finite numbers (a, b, c), got {coefficients!r}")
    if not _finite(eps) or eps <= 0:
        raise ZayaError(f"{where}: 'eps' must be a positive number, got {eps!r}")
    if backend not in NS_BACKENDS:
        raise ZayaError(f"{where}: 'ns_backend' must be one of {', '.join(NS_BACKENDS)}, got {backend!r}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _value(number: Any) -> Any:
    """A one-element tensor (torch's optimizers take `lr` as one) as a Python number; anything else as is."""
    return number.item() if isinstance(number, Tensor) and number.numel() == 1 else number


# ---- batches of same-shape matrices ---------------------------------------------------------------------


class _Item(Protocol):
    """A tensor of matrices to orthogonalise: it writes normalised matrices [start, stop) of its stack into a
    chunk of the batch."""

    @property
    def shape(self) -> torch.Size: ...  # as laid out in the batch: [m, n] or [E, m, n]

    @property
    def device(self) -> torch.device: ...

    @property
    def splittable(self) -> bool: ...  # whether its matrices may go to different chunks

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None: ...


# receives (item, start, stop, the item's orthogonalised matrices [start, stop) as [stop - start, m, n])
_Sink = Callable[[Any, int, int, Tensor], None]


@dataclass
class _Batch:
    """The items of one matrix shape [m, n] on one device, one after the other in a virtual [B, m, n] stack."""

    rows: int
    cols: int
    device: torch.device
    items: list[_Item] = field(default_factory=list)

    def run(
        self,
        steps: int,
        coefficients: tuple[float, float, float],
        eps: float,
        dtype: torch.dtype,
        backend: str,
        sink: _Sink,
        workspace: Workspace | None = None,
    ) -> None:
        """Chunk by chunk: write the chunk's matrices, iterate, and hand each item's part of the result to
        `sink`, which must consume it before it returns (the chunk's memory is reused). `workspace`, kept
        between calls on the CPU, saves the allocations."""
        compiled = _compiled(backend, self.device)
        total = sum(_count(item) for item in self.items)
        per = _chunk_size(self.rows, self.cols, total, dtype, self.device, compiled)
        chunks = list(self._chunks(per))
        if not chunks:  # only empty stacks
            return
        largest = max(sum(stop - start for _, start, stop in chunk) for chunk in chunks)
        if workspace is None or self.device.type != "cpu":
            workspace = Workspace()
        X_all = workspace.take("X", (largest, self.rows, self.cols), dtype, self.device)
        buffers = None if compiled else _Buffers(workspace, X_all)
        a, b, c = (float(v) for v in coefficients)
        for chunk in chunks:
            sizes = [stop - start for _, start, stop in chunk]
            X = X_all[: sum(sizes)]
            for (item, start, stop), view in zip(chunk, X.split(sizes), strict=True):
                item.write(view, start, stop, eps, workspace)
            X = _compiled_quintic()(X, steps, a, b, c) if compiled else _quintic_eager(X, steps, a, b, c, buffers)
            for (item, start, stop), view in zip(chunk, X.split(sizes), strict=True):
                sink(item, start, stop, view)

    def _chunks(self, per: int) -> Iterable[list[tuple[_Item, int, int]]]:
        """Segments (item, start, stop) grouped into chunks of at most `per` matrices; an item that may not
        be split goes whole into one chunk, alone if it does not fit."""
        chunk: list[tuple[_Item, int, int]] = []
        room = per
        for item in self.items:
            count = _count(item)
            start = 0
            while start < count:
                if room <= 0 or (chunk and not item.splittable and count > room):
                    yield chunk
                    chunk, room = [], per
                take = min(count - start, room) if item.splittable else count
                chunk.append((item, start, start + take))
                start += take
                room -= take
        if chunk:
            yield chunk


def _count(item: _Item) -> int:
    """How many matrices an item holds."""
    return item.shape[0] if len(item.shape) == 3 else 1


def _run_batches(
    items: Sequence[_Item],
    where: str,
    steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype,
    backend: str,
) -> list[Tensor]:
    """Orthogonalise `items` in one batch per matrix shape and device; results in input order, each in its
    item's shape and in `dtype`."""
    batches: dict[tuple, _Batch] = {}
    outputs: dict[int, Tensor] = {}
    for index, item in enumerate(items):
        if len(item.shape) not in (2, 3):
            raise ZayaError(
                f"{where}: tensor {index} has shape {list(item.shape)}, expected a matrix [m, n] or a stack [E, m, n]"
            )
        key = (*item.shape[-2:], item.device)
        batches.setdefault(key, _Batch(*item.shape[-2:], item.device)).items.append(item)
        outputs[id(item)] = torch.empty(item.shape, dtype=dtype, device=item.device)

    def keep(item: _Item, start: int, stop: int, result: Tensor) -> None:
        _stack(outputs[id(item)])[start:stop].copy_(result)

    for batch in batches.values():
        batch.run(steps, coefficients, eps, dtype, backend, keep)
    return [outputs[id(item)] for item in items]


@dataclass
class _Normalized:
    """A tensor of matrices, orthogonalised as it is."""

    matrices: Tensor
    splittable: bool = True

    @property
    def shape(self) -> torch.Size:
        return self.matrices.shape

    @property
    def device(self) -> torch.device:
        return self.matrices.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        for matrices, out in _slices(_stack(self.matrices)[start:stop], out_BMN):
            _normalize_into(matrices, out, eps)


@dataclass
class _Direction:
    """The momentum and update direction of one tensor of matrices (a DTensor's as full local matrices)."""

    grad: Tensor
    buffer: Tensor
    momentum: float
    nesterov: bool

    @property
    def shape(self) -> torch.Size:
        return _local_shape(self.grad)

    @property
    def device(self) -> torch.device:
        return self.grad.device

    @property
    def splittable(self) -> bool:
        return DTensor is None or not isinstance(self.grad, DTensor)

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        """B <- lerp(B, g, 1 - mu); out = U / max(||U||_F, eps) per matrix, U = lerp(g, B, mu) (Nesterov) or B,
        normalised in fp32 (or the gradient's precision, if finer) before the one rounding to out's dtype."""
        if not self.splittable:  # a DTensor: written whole (start, stop = 0, count)
            self.buffer.lerp_(self.grad, 1 - self.momentum)
            update = self.grad.lerp(self.buffer, self.momentum) if self.nesterov else self.buffer
            _normalize_into(_local_matrices(update).reshape(out_BMN.shape), out_BMN, eps)
            return
        stacks = _stack(self.grad)[start:stop], _stack(self.buffer)[start:stop], out_BMN
        for grad, buffer, out in _slices(*stacks):
            buffer.lerp_(grad, 1 - self.momentum)
            if self.nesterov:
                scratch = workspace.take("U", grad.shape, grad.dtype, grad.device)
                update = torch.lerp(grad, buffer, self.momentum, out=scratch)
                _normalize_into(update, out, eps, overwrite=True)
            else:
                _normalize_into(buffer, out, eps)


def _stack(tensor: Tensor) -> Tensor:
    """A matrix [m, n] as a stack [1, m, n] (a view); a stack as itself."""
    return tensor if tensor.ndim == 3 else tensor.unsqueeze(0)


def _slices(*stacks: Tensor) -> Iterable[tuple[Tensor, ...]]:
    """Matching slices of same-length stacks [E, m, n]: the whole stacks off the CPU, a few matrices
    (CPU_SLICE_BYTES of the first) at a time on it."""
    first = stacks[0]
    if first.device.type != "cpu":
        return [stacks]
    per = max(1, CPU_SLICE_BYTES // max(1, first.shape[-2] * first.shape[-1] * first.element_size()))
    return zip(*(stack.split(per) for stack in stacks), strict=True)


class Workspace:
    """Scratch tensors reused from chunk to chunk, batch to batch and (kept by an optimizer) step to step:
    one flat buffer per role and dtype, grown on demand. On the CPU a fresh allocation of this size is
    page-faulted in anew every time; a GPU's caching allocator recycles memory by itself, so there a
    workspace is not kept between steps (it would hold memory the forward pass could use)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def take(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised contiguous tensor, valid until the next `take` of the same role."""
        numel = math.prod(shape)
        buffer = self._buffers.get((role, dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(role, dtype, device)] = buffer
        return buffer[:numel].view(tuple(shape))


# ---- the optimizer --------------------------------------------------------------------------------------


def muon_defaults(
    lr: float | Tensor = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype | str = torch.bfloat16,
    ns_backend: str = "auto",
) -> dict[str, Any]:
    """The hyperparameters of a Muon param group as stored in it: `ns_dtype` by name, so that a state dict
    holds only tensors, numbers and strings."""
    return {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "nesterov": nesterov,
        "ns_coefficients": tuple(ns_coefficients) if isinstance(ns_coefficients, list) else ns_coefficients,
        "eps": eps,
        "ns_steps": ns_steps,
        "adjust_lr_fn": adjust_lr_fn,
        "ns_dtype": dtype_name(ns_dtype),
        "ns_backend": ns_backend,
    }


def validate_muon_group(group: MutableMapping[str, Any], where: str = "Muon") -> None:
    """Raise `ZayaError` naming the first hyperparameter or parameter of a Muon group that is unusable."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and (lr.numel() != 1 or not lr.is_floating_point()):
        raise ZayaError(
            f"{where}: a tensor 'lr' must hold one real floating-point number, got shape {list(lr.shape)} "
            f"and dtype {lr.dtype}"
        )
    for name, value in (("lr", _value(lr)), ("weight_decay", group["weight_decay"])):
        if not _finite(value) or value < 0:
            raise ZayaError(f"{where}: '{name}' must be a non-negative number, got {group[name]!r}")
    if not _finite(group["momentum"]) or not 0 <= group["momentum"] < 1:
        raise ZayaError(f"{where}: 'momentum' must be in [0, 1), got {group['momentum']!r}")
    if not isinstance(group["nesterov"], bool):
        raise ZayaError(f"{where}: 'nesterov' must be true or false, got {group['nesterov']!r}")
    _check_ns_settings(group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_backend"], where)
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ZayaError(
            f"{where}: 'adjust_lr_fn' must be one of {', '.join(ADJUST_LR_FNS)}, got {group['adjust_lr_fn']!r}"
        )
    if group["ns_dtype"] not in NS_DTYPES:
        raise ZayaError(f"{where}: 'ns_dtype' must be one of {', '.join(NS_DTYPES)}, got {group['ns_dtype']!r}")
    for param in group["params"]:
        if param.ndim not in (2, 3) or torch.is_complex(param):
            raise ZayaError(
                f"{where}: a parameter of shape {list(param.shape)} and dtype {param.dtype} is neither a real "
                "matrix [m, n] nor a stack of matrices [E, m, n]; optimise it with AdamW"
            )


class Muon(Optimizer):
    """Muon (momentum orthogonalised by Newton-Schulz) with the constructor and semantics of
    `torch.optim.Muon`, plus stacked expert parameters [E, m, n] (each of the E matrices orthogonalised on
    its own, under the learning-rate rule of one [m, n] matrix) and batched Newton-Schulz.

    `lr` may be a one-element tensor, as torch's optimizers allow; its value is read at every step. Beyond
    torch's arguments: `ns_dtype` (torch.bfloat16 or torch.float32, or their names) is the precision
    of the iteration; `ns_backend` is "eager", "compiled" or "auto" (compiled on GPUs, eager elsewhere).
    State: `momentum_buffer` per parameter, as torch keeps it.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_backend: str = "auto",
    ) -> None:
        defaults = muon_defaults(
            lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype, ns_backend
        )
        super().__init__(params, defaults)
        self._workspace = Workspace()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._workspace = Workspace()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "ns_dtype" in param_group:
            param_group["ns_dtype"] = dtype_name(param_group["ns_dtype"])
        super().add_param_group(param_group)
        validate_muon_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step for every parameter that has a gradient; returns the closure's loss, if given."""
        loss = run_closure(closure)
        muon_step(self.param_groups, self.state, self._workspace)
        return loss


@torch.no_grad()
def muon_step(
    groups: Sequence[MutableMapping[str, Any]],
    state: MutableMapping[Tensor, dict[str, Any]],
    workspace: Workspace | None = None,
) -> None:
    """One Muon step over `groups` (param groups holding Muon's hyperparameters), with momentum buffers in
    `state[param]["momentum_buffer"]`. Matrices of one shape and Newton-Schulz setting are orthogonalised
    together, whichever group they belong to. An optimizer passes the same `workspace` at every step."""
    batches: dict[tuple, _Batch] = {}
    for group in groups:
        settings = (group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"], group["ns_dtype"])
        lr = _value(group["lr"])  # a tensor lr: its current value, read once per step
        decay = 1 - lr * group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise ZayaError("Muon: sparse gradients are not supported")
            param_state = state[param]
            if "momentum_buffer" not in param_state:
                param_state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            if 0 in param.shape[-2:]:  # an empty matrix: nothing to orthogonalise or update
                continue
            direction = _Direction(param.grad, param_state["momentum_buffer"], group["momentum"], group["nesterov"])
            key = (*param.shape[-2:], direction.device, settings, group["ns_backend"])
            batches.setdefault(key, _Batch(*param.shape[-2:], direction.device)).items.append(
                _Step(param, direction, decay, adjusted_lr(lr, group["adjust_lr_fn"], *param.shape[-2:]))
            )
    for (_, _, _, (steps, coefficients, eps, dtype_name), backend), batch in batches.items():
        batch.run(steps, coefficients, eps, NS_DTYPES[dtype_name], backend, _Step.apply, workspace)


@dataclass
class _Step:
    """One parameter's part of a Muon step: W <- decay W - rate O, with decay = 1 - lr lambda and
    rate = lr s(m, n)."""

    param: Tensor
    direction: _Direction
    decay: float
    rate: float

    @property
    def shape(self) -> torch.Size:
        return self.direction.shape

    @property
    def device(self) -> torch.device:
        return self.direction.device

    @property
    def splittable(self) -> bool:
        return self.direction.splittable

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        self.direction.write(out_BMN, start, stop, eps, workspace)

    def apply(self, start: int, stop: int, orthogonal_BMN: Tensor) -> None:
        """W <- decay W - rate O for matrices [start, stop) of the parameter, with O their orthogonalised
        directions (all of a DTensor's full local matrices)."""
        if not self.splittable:
            pieces: Iterable[tuple[Tensor, ...]] = [
                (self.param, _as_param(orthogonal_BMN.view(self.shape), self.param))
            ]
        else:
            pieces = _slices(_stack(self.param)[start:stop], orthogonal_BMN)
        for param, orthogonal in pieces:
            if self.decay != 1:
                param.mul_(self.decay)
            param.add_(orthogonal, alpha=-self.rate)


# ---- DTensor parameters ---------------------------------------------------------------------------------


def _shards_whole_matrices(tensor: Tensor) -> bool:
    """A DTensor stack [E, m, n] split (or replicated) only along E: its local shard holds whole matrices."""
    return tensor.ndim == 3 and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in tensor.placements
    )


def _local_shape(tensor: Tensor) -> torch.Size:
    """The shape `_local_matrices(tensor)` will have, without gathering anything."""
    if DTensor is not None and isinstance(tensor, DTensor) and _shards_whole_matrices(tensor):
        return tensor.to_local().shape
    return tensor.shape


def _local_matrices(tensor: Tensor) -> Tensor:
    """The full matrices this rank orthogonalises for `tensor`: itself, its local shard when that holds
    whole matrices, else the gathered full tensor."""
    if DTensor is None or not isinstance(tensor, DTensor):
        return tensor
    return tensor.to_local() if _shards_whole_matrices(tensor) else tensor.full_tensor()


def _as_param(update: Tensor, param: Tensor) -> Tensor:
    """`update`, laid out as `_local_matrices(param)`, in the layout of `param`."""
    if DTensor is None or not isinstance(param, DTensor):
        return update
    if _shards_whole_matrices(param):
        return DTensor.from_local(
            update, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    # every rank holds the same full update: keep the local slice, without communication
    return distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None)


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """The loss of an optimizer's closure (re-evaluated with gradients enabled), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name under which a param group stores its Newton-Schulz dtype ("bfloat16" or "float32")."""
    if isinstance(dtype, torch.dtype):
        for name, value in NS_DTYPES.items():
            if value == dtype:
                return name
        raise ZayaError(f"Muon: 'ns_dtype' must be one of {', '.join(NS_DTYPES)}, got {dtype}")
    return {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
