"""The plan of a phase that keeps packed documents apart: its attention work follows the documents' mean length
(the kernel plan's own count, where the lengths are equal), its memory holds no [T, T] term and matches the bytes
autograd saves (one process, and split over 2 gloo ranks), the mean comes from a phase key or the datasets'
manifests, and ZAYA1-base's SFT phase at 131k on 1,024 MI300X."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ranks import run_distributed
from runs import ZAYA1_BASE_HAND
from zaya.config import load_config
from zaya.data.config import Source
from zaya.errors import ZayaError
from zaya.model.documents import Documents, document_positions, packed_documents
from zaya.model.masks import DocumentLayout
from zaya.model.presets import get_preset
from zaya.model.transformer import Zaya
from zaya.plan.devices import get_device
from zaya.plan.documents import MIN_BLOCK, DocumentPlan, causal_pairs, document_pairs, phase_documents
from zaya.plan.measure import activation_bytes as measured_bytes
from zaya.plan.memory import DeviceDetails, activation_bytes
from zaya.plan.planner import plan_run
from zaya.plan.timing import RooflineRates, attention_seconds
from zaya.train.config import Phase

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "zaya1-base.toml"
SEPARATOR = 1
CPU = {"fp32": DeviceDetails(1, 1 << 21), "bf16": DeviceDetails(32, 1 << 21)}  # as zaya.plan.compare's


# ---- attention work ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [128, 512, 1024, 4096])
def test_the_pairs_of_equal_documents_are_those_the_kernel_plan_allows(length):
    T = 4096
    layout = DocumentLayout((tuple(range(0, T, length)),), T)
    assert document_pairs(T, length) == layout.pairs()
    assert document_pairs(T, T) == document_pairs(T, 10 * T) == causal_pairs(T)
    assert document_pairs(T, 1) == document_pairs(T, MIN_BLOCK)  # a kernel's block at least


def test_attention_time_falls_with_the_documents_length():
    model = get_preset("zaya1-base")
    rates = RooflineRates({"bf16": 1e15}, 5e12, 0.5)
    causal = attention_seconds(model, rates, 131072, 1, 8, "bf16", 3)
    short = attention_seconds(model, rates, 131072, 1, 8, "bf16", 3, DocumentPlan(4096, "test"))
    assert short / causal == pytest.approx(4097 / 131073)
    assert attention_seconds(model, rates, 131072, 1, 8, "bf16", 3, DocumentPlan(131072, "test")) == causal


# ---- memory -------------------------------------------------------------------------------------------------

def _saved(config, ids: torch.Tensor, precision: str, documents: bool) -> int:
    torch.manual_seed(0)
    model = Zaya(config)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    kwargs = {"documents": packed_documents(inputs, SEPARATOR)} if documents else {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        return measured_bytes(functools.partial(model.loss, inputs, targets, **kwargs), model)[1]


def _rows(config, B: int, T: int, every: int) -> torch.Tensor:
    ids = torch.randint(2, config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    ids[:, every::every] = SEPARATOR
    return ids


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activations_with_documents_match_what_autograd_saves_on_one_device(precision):
    config = get_preset("micro", temp_init=1.0)
    B, T = 2, 512
    ids = _rows(config, B, T, 50)
    for documents in (False, True):
        predicted = activation_bytes(config, B * T, T, 1, precision, "none", CPU[precision], documents=documents)[0]
        # within the tolerance of tests/plan/test_accuracy.py; the plain model's own error is 4%
        assert predicted / _saved(config, ids, precision, documents) == pytest.approx(1, abs=0.08), documents


def test_activations_with_documents_grow_with_the_tokens_not_their_square():
    config = get_preset("micro", temp_init=1.0)
    saved = [_saved(config, _rows(config, 1, T, 100), "fp32", True) for T in (512, 2048)]
    predicted = [activation_bytes(config, T, T, 1, "fp32", "none", CPU["fp32"], documents=True)[0] for T in (512, 2048)]
    assert saved[1] / saved[0] < 4.4 and predicted[1] / predicted[0] < 4.4  # a [T, T] term would make it 16


def _split_worker(rank: int, world: int) -> tuple[int, int]:
    dist.init_process_group("gloo")
    from zaya.parallel.context import ContextParallel, SequenceLayout

    config = get_preset("micro", temp_init=1.0)
    T, B = 512, 2
    ids = _rows(config, B, T, 70)  # documents across the 2 x 8 chunks of 32 tokens
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = document_positions(inputs, SEPARATOR)
    cp = ContextParallel(SequenceLayout(T, world), dist.group.WORLD).for_documents(
        DocumentLayout.from_tokens(inputs, SEPARATOR), positions, chunks_per_rank=8)
    torch.manual_seed(0)
    model = Zaya(config)
    forward = functools.partial(model.loss, cp.shard(inputs), cp.shard(targets), sequence=cp,
                                positions=cp.positions(), documents=Documents(cp.shard(positions), None))
    saved = measured_bytes(forward, model)[1]
    return saved, activation_bytes(config, B * T // world, T, world, "fp32", "none", CPU["fp32"], documents=True)[0]


@pytest.mark.slow
def test_activations_with_documents_split_over_two_ranks_match_what_autograd_saves():
    for saved, predicted in run_distributed(_split_worker, 2, timeout=120):
        assert predicted / saved == pytest.approx(1, abs=0.05)


# ---- the mean length ----------------------------------------------------------------------------------------

def _train_mean(dataset: Path) -> float:
    train = json.loads((dataset / "manifest.json").read_text())["splits"]["train"]
    return train["num_tokens"] / train["num_documents"]


def test_the_mean_comes_from_the_phase_else_the_manifests_else_the_row(dataset, tmp_path):
    phase = Phase(sources=[Source(str(dataset))], isolate_documents=True)
    assert phase_documents(Phase(sources=[Source(str(dataset))]), 0, 4096) is None  # documents not kept apart
    keyed = phase_documents(Phase(sources=[Source(str(dataset))], isolate_documents=True, document_tokens=300), 2,
                            4096)
    assert (keyed.tokens, keyed.source) == (300, "phases.2.document_tokens")
    read = phase_documents(phase, 0, 1 << 20)
    assert read.tokens == round(_train_mean(dataset)) and "manifests" in read.source
    # documents per token add up: a source without a manifest counts as documents of the whole row
    missing = tmp_path / "elsewhere"
    mixed = phase_documents(Phase(sources=[Source(str(dataset), 3.0), Source(str(missing), 1.0)],
                                  isolate_documents=True), 0, 1 << 16)
    assert mixed.tokens == round(1 / (0.75 / _train_mean(dataset) + 0.25 / (1 << 16)))
    row = phase_documents(Phase(sources=[Source(str(missing))], isolate_documents=True), 0, 8192)
    assert row.tokens == 8192 and "whole row" in row.source
    # a manifest that is there but unreadable is said, not guessed around
    missing.mkdir()
    (missing / "manifest.json").write_text("{", encoding="utf-8")
    with pytest.raises(ZayaError, match=r"manifest\.json: not a readable manifest"):
        phase_documents(Phase(sources=[Source(str(missing))], isolate_documents=True), 0, 8192)


def test_document_tokens_without_documents_kept_apart_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "micro"\n[data]\npath = "data"\nseq_len = 64\n[[phases]]\nname = "sft"\n'
                    'document_tokens = 512\n', encoding="utf-8")
    with pytest.raises(ZayaError, match=r"key 'phases.0.document_tokens' = 512: phase 'sft' does not keep documents "
                                        r"apart \(isolate_documents\)"):
        load_config(path)
    assert load_config(path, ["phases.0.isolate_documents=true"]).phases[0].document_tokens == 512


# ---- ZAYA1-base's SFT phase ---------------------------------------------------------------------------------

def test_zaya1_base_plans_its_sft_phase_at_131k_with_the_work_of_its_documents():
    device = get_device("mi300x")

    def sft(*sets: str):
        plan = plan_run(load_config(BASE, [*ZAYA1_BASE_HAND, *sets]).resolve(1024), device, gpus_per_node=8)
        return plan.phases[-1]

    phase = sft()
    assert (phase.name, phase.seq_len, phase.cp, phase.documents) == \
        ("sft", 131072, 8, DocumentPlan(4096, "phases.3.document_tokens"))
    assert phase.fits and phase.memory.total < 192e9 and phase.steps > 0 and phase.hours > 0
    whole = sft("phases.3.document_tokens=131072")  # every row one document: causal attention
    assert phase.time.attention == pytest.approx(whole.time.attention * 4097 / 131073, rel=1e-9)
    assert phase.time.total < whole.time.total
    assert phase.memory.total == whole.memory.total  # the mask's size is no memory: there is no mask
