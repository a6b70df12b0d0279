"""A model with sliding-window blocks under FSDP2 on two gloo ranks: the same loss and gradients as one process
over the whole batch, with and without packed documents (rows longer than the window, so the band is used)."""

from __future__ import annotations

import os

import pytest
import torch

import zaya
from ranks import run_distributed
from zaya.model.documents import packed_documents
from zaya.parallel.config import ParallelConfig, ParallelizeConfig
from zaya.parallel.fsdp import parallelize, reduce_replicated_gradients
from zaya.parallel.launch import Launch
from zaya.parallel.mesh import init_parallel

EOS = 1


def _model():
    config = zaya.get_preset("micro", temp_init=1.0, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                             sliding_window=6, sliding_rope_theta=300.0, sliding_partial_rotary_factor=0.25)
    return zaya.build_model(config, seed=0)


def _loss(model, ids, packed: bool):
    documents = packed_documents(ids[:, :-1], EOS, window=model.config.active_window) if packed else None
    return model.loss(ids[:, :-1], ids[:, 1:], documents=documents)


def _whole(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank: int, world: int) -> dict:
    context = init_parallel(ParallelConfig(), torch.device("cpu"), Launch.from_env(os.environ))
    ids = torch.randint(2, 512, (4, 41), generator=torch.Generator().manual_seed(9))
    ids[:, [5, 17, 18, 30]] = EOS  # documents shorter and longer than the window
    out = {}
    for packed in (False, True):
        alone = _model()
        loss = _loss(alone, ids, packed)
        loss.backward()
        sharded = parallelize(_model(), context.fsdp_mesh, ParallelizeConfig())
        part = _loss(sharded, ids[2 * rank:2 * rank + 2], packed)
        part.backward()
        reduce_replicated_gradients(sharded, context.fsdp_mesh)  # the routers, whole on every rank
        parts = [torch.zeros(()) for _ in range(world)]
        torch.distributed.all_gather(parts, part.detach())
        mine = dict(alone.named_parameters())
        grads = {name: (_whole(p.grad), mine[name].grad) for name, p in sharded.named_parameters()}
        out[packed] = (loss.detach(), torch.stack(parts).mean(), grads)
    context.close()
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-documents"])
def test_a_sliding_model_trains_under_fsdp2_as_in_one_process(packed):
    results = _results()
    for result in results:
        whole, mean_of_parts, grads = result[packed]
        torch.testing.assert_close(mean_of_parts, whole, rtol=1e-5, atol=1e-6)
        for name, (sharded, alone) in grads.items():
            torch.testing.assert_close(sharded, alone, rtol=1e-4, atol=1e-6, msg=name)


_CACHE: list = []


def _results():
    if not _CACHE:  # both cases come from one launch of the ranks
        _CACHE.append(run_distributed(_worker, 2, timeout=240))
    return _CACHE[0]
