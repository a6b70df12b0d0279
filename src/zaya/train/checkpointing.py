"""What a training checkpoint holds, and how its tensors go in and out on any number of ranks.

The run's progress (`Progress`) and the stop rules' clock are JSON in train_state.json, beside the optimizer's
skeleton and the run config as resolved. The tensors:

    model        the model's state dict from `torch.distributed.checkpoint.state_dict.get_state_dict`:
                 parameter names (FQNs) as keys, and under FSDP2 DTensor shards, so that each rank writes
                 and reads only its own part
    optim        the optimizer's state tensors, keyed by parameter name rather than by index; everything else
                 of its state dict (hyperparameters, group membership) is a JSON skeleton in
                 train_state.json
    controller   the balancing controller's state (small, the same on every rank)

Loading reads into the state dicts of the model and the optimizer as the loading job built them, so DCP
reshards on the way: a checkpoint written by N ranks loads on M, whatever the mesh (2 -> 1, 1 -> 3,
HSDP -> FSDP).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from zaya import checkpoint as ckpt
from zaya.errors import ZayaError
from zaya.parallel.experts import ExpertViews
from zaya.train.balance import ControllerState


@dataclass
class Progress:
    """How far the run is: the non-tensor state every step moves on."""

    step: int = 0
    phase: int = 0
    phase_tokens: int = 0  # tokens trained in the current phase
    tokens: int = 0  # tokens trained in all
    samples: int = 0  # sequences trained in all: the batch ramp's clock
    loaders: dict[str, dict] = field(default_factory=dict)  # loader state per phase name
    fingerprints: dict[str, list[str]] = field(default_factory=dict)  # data fingerprints per phase name


def train_state(progress: Progress, clock: Any, skeleton: Any, record: dict) -> dict:
    """train_state.json: the progress and the clock side by side under "state", the optimizer's skeleton, and the
    run config as resolved."""
    return {"state": {**dataclasses.asdict(progress), **dataclasses.asdict(clock)}, "optimizer": skeleton,
            "config": record}


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, controller_state: ControllerState,
            views: ExpertViews | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
    """The checkpoint's tensors ({"model", "optim", "controller"}) and the optimizer's JSON skeleton. The
    tensors are the live ones (or views of them): write them before the next step changes them, or stage
    them (async save). Under expert parallelism (`views`) each expert stack is saved whole, keyed by expert."""
    model_state, optim_state = get_state_dict(model, optimizer)
    skeleton, optim_tensors = split_tensors(optim_state)
    if views is not None:
        model_state, optim_tensors = views.whole(model_state), views.whole(optim_tensors)
    return {"model": model_state, "optim": optim_tensors, "controller": controller_state.state_dict()}, skeleton


def restore(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            controller_state: ControllerState, skeleton: Any, process_group=None,
            views: ExpertViews | None = None) -> None:
    """Load checkpoint `directory` into `model`, `optimizer` and the controller, whatever the world size
    (and expert parallelism: `views`) that wrote it; `skeleton` is the optimizer skeleton saved with it."""
    # a fresh optimizer has no state yet: it needs tensors of the right layout to load into (torch's
    # state-dict API would otherwise make them with a step of zero gradients and learning rate)
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()
    model_state, optim_state = get_state_dict(model, optimizer)
    _, optim_tensors = split_tensors(optim_state)
    wanted = _tensor_keys(skeleton)
    missing = sorted(wanted - set(optim_tensors))
    if missing:
        raise ZayaError(f"{directory}: the checkpoint has optimizer state '{missing[0]}', which this model "
                        f"and optimizer do not ({len(missing)} such tensors)")
    optim_tensors = {key: optim_tensors[key] for key in sorted(wanted)}
    controller = controller_state.state_dict()
    tensors = {"model": model_state, "optim": optim_tensors, "controller": controller}
    if views is not None:  # whole views of this rank's experts: loading into them fills the originals
        tensors = {"model": views.whole(model_state), "optim": views.whole(optim_tensors), "controller": controller}
    ckpt.load_tensors(directory, tensors, process_group=process_group)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=join_tensors(skeleton, optim_tensors))
    controller_state.load_state_dict(controller)


def _tensor_keys(skeleton: Any) -> set[str]:
    """The tensor keys a skeleton of `split_tensors` refers to."""
    if "tensor" in skeleton:
        return {skeleton["tensor"]}
    if "dict" in skeleton:
        children = [child for _, child in skeleton["dict"]]
    else:
        children = skeleton.get("list") or skeleton.get("tuple") or []
    keys: set[str] = set()
    for child in children:
        keys |= _tensor_keys(child)
    return keys


def split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Separate a nested structure into a JSON skeleton and its tensors (replaced by {"tensor": key})."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {"tensor": path}
        if isinstance(node, dict):
            return {"dict": [[_json_key(k), walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            kind = "tuple" if isinstance(node, tuple) else "list"
            return {kind: [walk(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"value": node}
        raise TypeError(f"cannot checkpoint a {type(node).__name__} at '{path}'")

    return walk(obj, prefix), tensors


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if "tensor" in skeleton:
        return tensors[skeleton["tensor"]]
    if "dict" in skeleton:
        return {k: join_tensors(v, tensors) for k, v in skeleton["dict"]}
    if "list" in skeleton:
        return [join_tensors(v, tensors) for v in skeleton["list"]]
    if "tuple" in skeleton:
        return tuple(join_tensors(v, tensors) for v in skeleton["tuple"])
    return skeleton["value"]


def check_skeleton(skeleton: Any, source: Path) -> None:
    """`skeleton` is what `split_tensors` makes (read back from `source`, train_state.json), or `ZayaError`: a
    skeleton of another shape would fail deep inside `restore` instead."""
    todo = [(skeleton, "optimizer")]
    while todo:
        node, where = todo.pop()
        kinds = [key for key in ("tensor", "dict", "list", "tuple", "value") if isinstance(node, dict) and key in node]
        if len(kinds) != 1 or len(node) != 1:
            raise ZayaError(f"{source}: field '{where}' is not a part of an optimizer skeleton")
        (kind,) = kinds
        value = node[kind]
        if kind == "tensor" and not isinstance(value, str):
            raise ZayaError(f"{source}: field '{where}.tensor' must be a string")
        if kind == "value" and not (value is None or isinstance(value, (bool, int, float, str))):
            raise ZayaError(f"{source}: field '{where}.value' must be a JSON scalar")
        if kind in ("list", "tuple"):
            if not isinstance(value, list):
                raise ZayaError(f"{source}: field '{where}.{kind}' must be a list")
            todo += [(child, f"{where}.{kind}.{i}") for i, child in enumerate(value)]
        if kind == "dict":
            pairs = value if isinstance(value, list) else None
            if pairs is None or not all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                                        and not isinstance(pair[0], bool) for pair in pairs):
                raise ZayaError(f"{source}: field '{where}.dict' must be a list of [key, value] pairs")
            todo += [(child, f"{where}.dict.{i}") for i, (_, child) in enumerate(pairs)]


def model_tensors(model: torch.nn.Module, controller_state: ControllerState) -> list[torch.Tensor]:
    """What a checkpoint saves of the model: its parameters and buffers (the balancing biases), and the balancing
    controller's state."""
    controller = [t for t in controller_state.state_dict().values() if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *controller]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of the optimizer's state (moments, momenta, step counts)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def nonfinite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if this rank's part of any of `tensors` holds a NaN or an infinity, else 0.0: a 0-d float tensor on
    `device`, made without waiting for it (the caller reduces it over the ranks, and reads it once)."""
    peaks = []
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and local.numel():
            # the largest magnitude: NaN if any element is NaN, infinite if any is; no copy of the tensor
            peaks.append(torch.linalg.vector_norm(local.detach(), ord=math.inf).float().to(device))
    if not peaks:
        return torch.zeros((), device=device)
    return (~torch.isfinite(torch.stack(peaks))).any().float()


def check_finite(step: int, model: list[torch.Tensor], optimizer: list[torch.Tensor], device: torch.device,
                 all_reduce: Callable[[torch.Tensor], None]) -> None:
    """No checkpoint of NaN: the model's and the optimizer's tensors (`model_tensors`, `optimizer_tensors`) are
    finite on every rank (one reduction over them, `all_reduce`, and one read: at checkpoint time, so that the step
    itself never waits for it), or one `ZayaError` on every rank before checkpoint `step` is written."""
    flags = torch.stack([nonfinite(model, device), nonfinite(optimizer, device)])
    all_reduce(flags)
    broken = [what for what, flag in zip(("the model's weights", "the optimizer's state"), flags.tolist(),
                                         strict=True) if flag]
    if broken:
        raise ZayaError(f"step {step}: {' and '.join(broken)} hold NaN or infinite values (a learning rate or an "
                        f"initialisation too large?); stopping without writing checkpoint step {step}, the last "
                        "committed one is kept")


def _json_key(key: Any) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise TypeError(f"cannot checkpoint a dict key of type {type(key).__name__}")
