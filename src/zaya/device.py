"""Everything that depends on the accelerator vendor lives here, so no other module checks for one.

ROCm builds of PyTorch expose AMD GPUs through the `torch.cuda` namespace, so "cuda" below means either vendor.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from zaya.errors import ZayaError
from zaya.schema import shown


def tune_host_allocator() -> bool:
    """Keep freed host memory in the process instead of returning it to the kernel (glibc only).

    Training allocates and frees tensors of tens of MiB every step; by default glibc serves those with fresh
    mmap()s, so every step pays hundreds of thousands of page faults (measured: a quarter of a CPU step of
    the `small` preset). Returns whether the setting was applied."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 1 << 30))


def default_device() -> torch.device:
    """The accelerator if one is visible (CUDA or ROCm), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` means the default device; strings such as "cpu" or "cuda:1" are parsed, and refused in one line
    (`ZayaError`) when they name no device or one this machine does not have."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ZayaError(f"device {shown(device)}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if resolved.type == "meta":  # shapes without data: a model built there computes nothing
        raise ZayaError(f"device {shown(str(device))}: holds no data, so nothing runs on it; zaya runs on cpu and "
                        "cuda (ROCm too) devices")
    if resolved.type == "cpu" and resolved.index not in (None, 0):
        raise ZayaError(f"device {shown(str(device))}: the CPU is one device (cpu, or cpu:0)")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ZayaError(f"device {str(device)!r}: this machine has no GPU that torch can use (a CPU build of "
                            "torch, or no driver)")
        if resolved.index is not None and resolved.index >= count:
            raise ZayaError(f"device {str(device)!r}: this machine has {count} GPU(s), numbered from 0")
    elif resolved.type != "cpu":
        raise ZayaError(f"device {shown(str(device))}: zaya runs on cpu and cuda (ROCm too) devices")
    return resolved


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the process with `local_rank` on its node: an accelerator given without an index means
    the one of that number (torchrun starts one process per GPU), made the current one."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    return device


def pinned_host_memory() -> bool:
    """Whether host buffers that an accelerator copies into should be pinned (page-locked): only where an
    accelerator exists; a CPU build of torch cannot pin at all."""
    return torch.cuda.is_available()


def distributed_backend(device: torch.device) -> str:
    """The collective library for tensors on `device`: NCCL on GPUs (RCCL on ROCm builds, under the same
    name), gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: allocated accelerator memory, or the peak resident set on the
    CPU (which counts everything the process mapped, the interpreter included)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kilobytes elsewhere


def is_accelerator(device: torch.device) -> bool:
    """Whether `device` is a GPU (CUDA or ROCm) rather than the host's CPU."""
    return device.type == "cuda"


def accelerator_name(device: torch.device) -> str | None:
    """The accelerator's name as its driver reports it ("NVIDIA H100 80GB HBM3"), None for the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def default_accelerator() -> torch.device:
    """The device type a plan for a GPU models the code's choices on, whether or not one is present here."""
    return torch.device("cuda")


def backend_fits(backend: str, device: torch.device) -> bool:
    """Whether the collective library `backend` can move tensors of `device` (NCCL/RCCL need a GPU)."""
    return backend != "nccl" or device.type == "cuda"


def accelerator_rng_states() -> list[torch.Tensor]:
    """The random-number-generator states of every visible accelerator (none on a machine without one)."""
    return list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []


def set_accelerator_rng_states(states: list[torch.Tensor]) -> None:
    """Restore `accelerator_rng_states()`; states saved where there was an accelerator are ignored where none is."""
    if states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states)


def device_present(device: str | torch.device) -> bool:
    """Whether `device` exists here: an accelerator named on a machine that has none does not."""
    return torch.device(device).type != "cuda" or torch.cuda.is_available()


def compiles_newton_schulz(device: torch.device) -> bool:
    """Whether Newton-Schulz's `auto` backend compiles the iteration on `device`: on accelerators, where one
    kernel per step beats the eager iteration's launches; the CPU keeps the eager, block-symmetric form."""
    return device.type == "cuda"


def use_tf32(device: torch.device, enabled: bool) -> None:
    """Let fp32 matmuls and convolutions on `device` use TF32 tensor cores (a process-wide switch of torch's);
    CPUs have none."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class DeviceTimer:
    """Times the work queued on `device` between `__init__` and `stop` without waiting for it: on accelerators
    through two timing events, read (waiting for the end one only then) by `seconds`; on the CPU, whose work runs
    as it is queued, by the host clock."""

    def __init__(self, device: torch.device):
        self._events, self._seconds = None, None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> DeviceTimer:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._started
        return self

    def seconds(self) -> float:
        if self._seconds is None:
            start, end = self._events
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1e3
        return self._seconds


def compiles_training(device: torch.device) -> bool:
    """What `train.compile = "auto"` is on `device`: on accelerators, where one graph per block launches a
    fraction of the eager kernels; off on CPUs, where the compilation (79 s for `small` on a 2-core Zen 3) buys
    8-12% a step (`benchmarks/train_step.py`), so it pays back only after 100-500 steps, needs a C++ compiler,
    and would take a tenth of the demo's time."""
    return device.type == "cuda"


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (a no-op on the CPU); benchmarks call this around timed regions."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vendor(device: torch.device) -> str:
    """'amd', 'nvidia' or 'cpu': for logs and peak-FLOP tables, never for choosing code paths."""
    if device.type != "cuda":
        return "cpu"
    return "amd" if torch.version.hip else "nvidia"


def grouped_mm_pays_for_empty_groups(device: torch.device) -> bool:
    """True where `torch._grouped_mm` runs one GEMM per group, empty groups included (the CPU kernel does):
    there, a few tokens over many experts are cheaper through gathered expert weights."""
    return device.type == "cpu"


def grouped_mm_row_multiple(device: torch.device, dtype: torch.dtype) -> int:
    """Each expert's rows are padded (with zero rows) to a multiple of this before the grouped matmuls.
    On the CPU, half-precision groups run as one oneDNN GEMM each, and oneDNN JIT-builds a kernel for every
    shape it has not seen, which costs more than a small group's GEMM itself; on multiples of 32 the shapes
    recur and come from its primitive cache. fp32 GEMMs (BLAS) and accelerator kernels, which take the group
    offsets as data, gain nothing from padding."""
    return 32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else 1


def newton_schulz_blocks_from(device: torch.device) -> int | None:
    """The smallest Gram side (min(m, n), even) from which the eager Newton-Schulz iteration computes only
    three of the four 2 x 2 blocks of X X^T and of b A + c A^2 (they are symmetric): 3/4 of those products'
    FLOPs, in GEMMs of half the size. On a 2-core Zen 5 with oneDNN's bf16 GEMMs, 5 steps measured 1.18x-1.21x
    faster for 512-wide Grams and 0.93x-0.95x for 256-wide ones, where half-size GEMMs lose more than the
    FLOPs saved. None on accelerators: their iteration is compiled."""
    return 512 if device.type == "cpu" else None


def batched_matmul_multiple(device: torch.device) -> int:
    """The batch size of which a batched matmul's batch should be a multiple: on a CPU the number of threads,
    since oneDNN hands each thread whole matrices of the batch (measured on a 2-core Zen 5: a batch of 21 or
    11 512 x 256 iterations runs 3-8% slower per matrix than one of 16 or 32); 1 on accelerators."""
    return max(1, torch.get_num_threads()) if device.type == "cpu" else 1


def fused_block_attention(device: torch.device):
    """(forward, backward) of a fused attention kernel that returns its log-sum-exp and differentiates from a
    given output and log-sum-exp (context-parallel attention merges blocks with them), or None where only
    plain matmuls are known to work. The CPU's flash kernel does both (fp64 included); the GPU kernels'
    variants are not wired in yet."""
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if device.type == "cpu" and forward is not None and backward is not None:
        return forward, backward
    return None


def loss_chunk_logits(device: torch.device) -> int:
    """How many logits the fused LM-head loss forms at once: on a CPU few enough for the softmax passes to
    stay in cache (2M, 8 MiB in fp32); on an accelerator enough rows for big matmuls (256M)."""
    return 1 << 21 if device.type == "cpu" else 1 << 28


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast is running in on `device`, or None when autocast is off."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


# how long a start-up measures the peak for its MFU figure: every start of every rank pays it, and 0.1 s reads
# within the 0.5 s measurement's own run-to-run spread on CPUs (126-160 against 126-142 GFLOP/s on one machine);
# `zaya shapes` measures the peak properly
STARTUP_MEASURE_S = 0.1


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 0.5
) -> float:
    """Measured FLOP/s of square matmuls in `dtype` on `device`: this machine's practical peak. The side
    starts at 256 and doubles up to `size` while one product takes under a tenth of `seconds`, so that a
    device without fast `dtype` matmuls is measured in about `seconds` too (bf16 on a CPU without native
    bf16 instructions ran at 0.3 GFLOP/s on a 2048 side: minutes for the old fixed-size measurement)."""
    import time

    side = 256
    while True:
        a = torch.randn(side, side, device=device).to(dtype)
        b = torch.randn(side, side, device=device).to(dtype)
        torch.mm(a, b)  # warm-up: kernel selection, first-touch of the output
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if side >= size or time.perf_counter() - start > seconds / 10:
            break
        side *= 2
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and runs >= 3:
            return 2 * side**3 * runs / elapsed


def fast_bf16_matmul(device: torch.device,
                     measure: Callable[[torch.device, torch.dtype], float] | None = None) -> bool:
    """Whether bf16 matmuls on `device` run faster than fp32 ones: always on an accelerator; on a CPU measured
    (about 0.3 s), since only CPUs with native bf16 instructions (AVX-512 BF16, AMX) have fast ones. The two are
    timed in turns, three times each, and their medians compared, so that a machine whose load changes during
    the measurement does not favour one of them."""
    if device.type == "cuda":
        return True
    measure = measure or (lambda dev, dtype: measure_matmul_flops(dev, dtype, size=512, seconds=0.05))
    bf16, fp32 = [], []
    for _ in range(3):
        bf16.append(measure(device, torch.bfloat16))
        fp32.append(measure(device, torch.float32))
    return statistics.median(bf16) > statistics.median(fp32)


def auto_precision(device: torch.device, fast_bf16: Callable[[torch.device], bool] = fast_bf16_matmul) -> str:
    """What `train.precision = "auto"` is on `device`: bf16 where its bf16 matmuls are fast (`fast_bf16`), else
    fp32."""
    return "bf16" if fast_bf16(device) else "fp32"


def default_gemm_dtype(device: torch.device) -> torch.dtype:
    """The dtype `zaya shapes` measures in by default: bf16 on an accelerator, fp32 on a CPU (CPUs without
    native bf16 instructions multiply bf16 ~100x slower than fp32: 1.1 against 122 GFLOP/s measured on a
    2-core EPYC)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def device_label(device: torch.device) -> str:
    """What `device` is, for tables and logs: the GPU's name, or the CPU's model name."""
    name = accelerator_name(device)
    if name is not None:
        return name
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: the accelerator's, or the host's RAM for the CPU (0 if unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


# a container's memory limit and use (cgroup v2, then v1): the kernel stops a process there, whatever the host has
_CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def memory_available_bytes(device: torch.device) -> int:
    """The memory a run starting now on `device` can take: an accelerator's whole memory, or on the CPU the host's
    available memory (the kernel's MemAvailable, within the container's limit: what a process can allocate
    before the kernel kills it); 0 if unknown."""
    if device.type != "cpu":
        return device_memory_bytes(device)
    figures = []
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    figures.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_MEMORY:
        try:
            with open(limit_file, encoding="ascii") as limit, open(usage_file, encoding="ascii") as usage:
                text = limit.read().strip()
                if text.isdigit() and int(text) < 2**60:  # "max", or v1's unlimited 2**63 rounded to pages
                    figures.append(max(0, int(text) - int(usage.read().strip())))
            break
        except (OSError, ValueError):
            continue
    if not figures:
        try:
            figures.append(int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")))
        except (ValueError, OSError, AttributeError):
            return 0
    return min(figures)


# The variables that choose which GPUs a process sees: CUDA's, and ROCm's two (HIP for the runtime, ROCR for
# the kernel driver's agents). A supervisor that cordons a GPU sets all of them, so it needs no vendor check.
VISIBLE_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_devices(environ: dict[str, str]) -> list[int] | None:
    """The GPU indices an environment restricts processes to, or None if it does not restrict them."""
    for name in VISIBLE_DEVICE_VARIABLES:
        value = environ.get(name)
        if value is not None and value.strip():
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                return None  # UUIDs: not renumbered here
    return None


def visible_devices_env(indices: list[int]) -> dict[str, str]:
    """The environment that shows processes exactly the GPUs `indices` (physical numbering)."""
    value = ",".join(str(i) for i in indices)
    return {name: value for name in VISIBLE_DEVICE_VARIABLES}


def launches_overlap_compute(device_type: str) -> bool:
    """Whether the host's cost of issuing an operator overlaps the device's execution of the previous ones:
    on accelerators kernels are queued asynchronously, so dispatch costs time only where it outruns the
    kernels; on a CPU the same threads dispatch and compute, so it adds up."""
    return device_type != "cpu"
