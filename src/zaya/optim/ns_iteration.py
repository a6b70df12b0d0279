"""Newton-Schulz orthogonalisation, batched over every matrix of one shape.

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

Everything here works on full local matrices: `zaya.optim.muon` feeds it the momentum directions of the
parameters, and under sharding `zaya.optim.distributed` feeds it the matrices a rank owns, gathered from their
shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from zaya.device import batched_matmul_multiple, compiles_newton_schulz, newton_schulz_blocks_from
from zaya.errors import ZayaError
from zaya.optim.config import NS_BACKENDS, NS_COEFFICIENTS, NS_DTYPE_NAMES, NS_EPS, NS_STEPS

NS_DTYPES = {name: getattr(torch, name) for name in NS_DTYPE_NAMES}

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
    check_ns_settings(steps, coefficients, eps, backend)
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
    check_ns_settings(steps, coefficients, eps, backend)
    return run_batches([_Normalized(m) for m in matrices], "orthogonalize", steps, coefficients, eps, dtype, backend)


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of `steps` iterations on one [rows, cols] matrix: with k = min, l = max of the two,
    each step costs 2 k^2 l (A = X X^T) + 2 k^3 (A^2) + 2 k^2 l ((bA + cA^2) X)."""
    k, l = min(rows, cols), max(rows, cols)
    return steps * (4 * k * k * l + 2 * k**3)


# ---- the iteration --------------------------------------------------------------------------------------


def normalize_into(G_BMN: Tensor, out_BMN: Tensor, eps: float, *, overwrite: bool = False) -> None:
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
    return backend == "compiled" or (backend == "auto" and compiles_newton_schulz(device))


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


def check_ns_settings(steps: Any, coefficients: Any, eps: Any, backend: Any, where: str = "newton_schulz") -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps < 100:
        raise ZayaError(f"{where}: 'ns_steps' must be an integer in 1..99, got {steps!r}")
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or not all(map(finite, coefficients)):
        raise ZayaError(f"{where}: 'ns_coefficients' must be three finite numbers (a, b, c), got {coefficients!r}")
    if not finite(eps) or eps <= 0:
        raise ZayaError(f"{where}: 'eps' must be a positive number, got {eps!r}")
    if backend not in NS_BACKENDS:
        raise ZayaError(f"{where}: 'ns_backend' must be one of {', '.join(NS_BACKENDS)}, got {backend!r}")


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- batches of same-shape matrices ---------------------------------------------------------------------


class Item(Protocol):
    """A tensor of matrices to orthogonalise: it writes normalised matrices [start, stop) of its stack into a
    chunk of the batch."""

    @property
    def shape(self) -> torch.Size: ...  # as laid out in the batch: [m, n] or [E, m, n]

    @property
    def device(self) -> torch.device: ...

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None: ...


# receives (item, start, stop, the item's orthogonalised matrices [start, stop) as [stop - start, m, n])
Sink = Callable[[Any, int, int, Tensor], None]


@dataclass
class Batch:
    """The items of one matrix shape [m, n] on one device, one after the other in a virtual [B, m, n] stack."""

    rows: int
    cols: int
    device: torch.device
    items: list[Item] = field(default_factory=list)

    def run(
        self,
        steps: int,
        coefficients: tuple[float, float, float],
        eps: float,
        dtype: torch.dtype,
        backend: str,
        sink: Sink,
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

    def _chunks(self, per: int) -> Iterable[list[tuple[Item, int, int]]]:
        """Segments (item, start, stop) grouped into chunks of at most `per` matrices; an item's matrices
        may go to consecutive chunks."""
        chunk: list[tuple[Item, int, int]] = []
        room = per
        for item in self.items:
            count = _count(item)
            start = 0
            while start < count:
                if room <= 0:
                    yield chunk
                    chunk, room = [], per
                take = min(count - start, room)
                chunk.append((item, start, start + take))
                start += take
                room -= take
        if chunk:
            yield chunk


def _count(item: Item) -> int:
    """How many matrices an item holds."""
    return item.shape[0] if len(item.shape) == 3 else 1


def run_batches(
    items: Sequence[Item],
    where: str,
    steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype,
    backend: str,
) -> list[Tensor]:
    """Orthogonalise `items` in one batch per matrix shape and device; results in input order, each in its
    item's shape and in `dtype`."""
    batches: dict[tuple, Batch] = {}
    outputs: dict[int, Tensor] = {}
    for index, item in enumerate(items):
        if len(item.shape) not in (2, 3):
            raise ZayaError(
                f"{where}: tensor {index} has shape {list(item.shape)}, expected a matrix [m, n] or a stack [E, m, n]"
            )
        key = (*item.shape[-2:], item.device)
        batches.setdefault(key, Batch(*item.shape[-2:], item.device)).items.append(item)
        outputs[id(item)] = torch.empty(item.shape, dtype=dtype, device=item.device)

    def keep(item: Item, start: int, stop: int, result: Tensor) -> None:
        as_stack(outputs[id(item)])[start:stop].copy_(result)

    for batch in batches.values():
        batch.run(steps, coefficients, eps, dtype, backend, keep)
    return [outputs[id(item)] for item in items]


@dataclass
class _Normalized:
    """A tensor of matrices, orthogonalised as it is."""

    matrices: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.matrices.shape

    @property
    def device(self) -> torch.device:
        return self.matrices.device

    def write(self, out_BMN: Tensor, start: int, stop: int, eps: float, workspace: Workspace) -> None:
        for matrices, out in cpu_slices(as_stack(self.matrices)[start:stop], out_BMN):
            normalize_into(matrices, out, eps)


def as_stack(tensor: Tensor) -> Tensor:
    """A matrix [m, n] as a stack [1, m, n] (a view); a stack as itself."""
    return tensor if tensor.ndim == 3 else tensor.unsqueeze(0)


def cpu_slices(*stacks: Tensor) -> Iterable[tuple[Tensor, ...]]:
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
