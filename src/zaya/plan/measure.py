"""What a run really holds, measured the same way on every device, to test the planner's predictions against.

- State: the bytes of the storages behind this rank's parameters, gradients and optimizer state (FSDP2's
  local shards: each storage counted once, so a unit's gradients, views of one reduce-scatter output, count
  once and padded shards count with their padding).
- Activations: the bytes autograd saves for backward during a forward pass (each storage once, parameters
  and their gathered copies left out), plus the inputs that activation checkpointing keeps to recompute its
  regions (autograd does not see those: the checkpoint's own hooks replace the saved tensors inside a
  region). On a CPU there is no allocator to ask for peak bytes of one phase, and the resident set counts
  the interpreter and every freed page the allocator kept; saved tensors are what backward will need, the
  quantity the activation model predicts, on any device.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zaya.parallel.dtensor import local
from zaya.parallel.launch import Launch


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages: dict[int, int] = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{parameters, gradients, optimizer_state}: bytes this rank holds for each (see the module docstring)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return {"parameters": _storage_bytes(params), "gradients": _storage_bytes(grads),
            "optimizer_state": _storage_bytes(state)}


def activation_bytes(forward: Callable[[], Any], model: nn.Module) -> tuple[Any, int]:
    """(forward(), bytes saved for backward): see the module docstring. Checkpointed regions are the modules
    `zaya.parallel.fsdp.recompute_in_backward` was applied to."""
    from zaya.parallel.fsdp import is_recomputed

    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> None:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # parameters, and FSDP2's unsharded ones (its all-gather buffers, communication buffers that it frees
        # and re-gathers), are saved as the parameter objects themselves or views of them; identified so, not
        # by address, which freed buffers hand on to later activations
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):
            keep(tensor)
        return tensor

    def inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                keep(value)

    handles = [module.register_forward_pre_hook(inputs, with_kwargs=True)
               for module in model.modules() if is_recomputed(module)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = forward()
    finally:
        for handle in handles:
            handle.remove()
    return result, sum(storages.values())


def measured_step(launch: Launch, preset: str, precision: str, seq_len: int, micro_batch_size: int,
                  micro_batches: int, dp_replicate: int = 1, cp: int = 1, activation_checkpointing: str = "none",
                  cp_kernel: str = "allgather", ns_dtype: str = "float32", steps: int = 2,
                  seed: int = 0, ep: int = 1) -> dict:
    """On each rank of a launched job (`launch`: torchrun's environment): build the model of `preset` as the
    trainer does (FSDP2 over the job's mesh, Muon + AdamW), run `steps` optimizer steps of `micro_batches`
    micro-batches of random tokens (Newton-Schulz in `ns_dtype`; the experts over `ep` ranks), and return what
    the last step held and
    sent: `state` (`state_bytes`), `activations` (of its first micro-batch), `comm` (bytes by collective
    kind; this loop makes none of the trainer's own all-reduces) and `seconds` (the median step after the
    first, which warms the allocator and the kernels up; the only one if `steps` is 1)."""
    import time

    from zaya.device import tune_host_allocator
    from zaya.model.presets import get_preset
    from zaya.model.transformer import Zaya
    from zaya.optim.config import OptimConfig
    from zaya.optim.hybrid import build_optimizer
    from zaya.parallel.config import ParallelConfig, ParallelizeConfig
    from zaya.parallel.context import ContextParallel, SequenceLayout
    from zaya.parallel.fsdp import parallelize, reduce_and_clip
    from zaya.parallel.mesh import init_parallel
    from zaya.train.config import TrainSection

    tune_host_allocator()  # as the trainer does
    device = torch.device("cpu")
    context = init_parallel(ParallelConfig(dp_replicate=dp_replicate, cp=cp, ep=ep, cp_kernel=cp_kernel), device,
                            launch)
    try:
        torch.manual_seed(seed)
        config = get_preset(preset, temp_init=1.0)
        sharding = ParallelizeConfig(activation_checkpointing, bf16=precision == "bf16")
        experts = context.experts
        model = parallelize(Zaya(config), context.fsdp_mesh, sharding, context.counter, experts)
        optimizer = build_optimizer(model, OptimConfig(ns_dtype=ns_dtype), comm=context.counter)
        sequence = ContextParallel(SequenceLayout(seq_len, cp), context.cp_group, cp_kernel, context.counter) \
            if cp > 1 else None
        generator = torch.Generator().manual_seed(seed + context.dp_rank)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        result: dict = {}
        times = []
        for _ in range(steps):
            context.counter.take()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            for micro in range(micro_batches):
                ids = torch.randint(0, config.vocab_size, (micro_batch_size, seq_len + 1), generator=generator)
                inputs, targets = ids[:, :-1], ids[:, 1:]
                kwargs = {}
                if sequence is not None:
                    inputs, targets = sequence.shard(inputs), sequence.shard(targets)
                    kwargs = {"sequence": sequence, "positions": sequence.positions()}
                with autocast:
                    loss, saved = activation_bytes(functools.partial(model.loss, inputs, targets, **kwargs), model)
                if micro == 0:
                    result["activations"] = saved
                (loss / micro_batches).backward()
            reduce_and_clip(model, [p for p in model.parameters() if p.grad is not None], context,
                            TrainSection.grad_clip)
            optimizer.step()
            times.append(time.perf_counter() - started)
            result["comm"] = context.counter.take()
        result["seconds"] = statistics.median(times[1:] or times)
        result["state"] = state_bytes(model, optimizer)
        return result
    finally:
        context.close()
