"""The planner against real runs on gloo ranks of this machine: state bytes per rank within 5%, activation
memory within 20% (the bytes autograd saves, `zaya.plan.measure`), bytes sent per step within 10% by
collective. (Its step time against the one measured here is a benchmark: benchmarks/plan_accuracy.py.)"""

from __future__ import annotations

import os

import pytest

from ranks import run_distributed
from zaya.parallel.launch import Launch
from zaya.plan.compare import ACCURACY_CASES, Case, predicted_step
from zaya.plan.measure import measured_step

# the cases of benchmarks/plan_accuracy.py but the `small` preset's: the formulas are the same at every size
CASES = tuple(case for case in ACCURACY_CASES if case.preset != "small")


def _measure(rank: int, world: int, kwargs: dict) -> dict:
    return measured_step(Launch.from_env(os.environ), **kwargs, steps=1)


def _id(case: Case) -> str:
    extra = f"-hsdp{case.dp_replicate}" if case.dp_replicate > 1 else ""
    extra += f"-cp{case.cp}-{case.cp_kernel}" if case.cp > 1 else ""
    extra += f"-ac-{case.activation_checkpointing}" if case.activation_checkpointing != "none" else ""
    extra += f"-ep{case.ep}" if case.ep > 1 else ""
    return f"{case.preset}-{case.precision}-{case.world}rank{extra}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_predicted_memory_and_traffic_match_a_real_step(case):
    measured = run_distributed(_measure, case.world, case.measure_kwargs(), timeout=600)
    for rank, result in enumerate(measured):
        predicted = predicted_step(case, rank)
        state = sum(result["state"].values())
        assert abs(sum(predicted["state"].values()) / state - 1) <= 0.05, (rank, result["state"], predicted["state"])
        assert abs(predicted["activations"] / result["activations"] - 1) <= 0.20, \
            (rank, result["activations"], predicted["activations"])
        if case.world > 1:
            sent = sum(result["comm"].values())
            assert abs(sum(predicted["comm"].values()) / sent - 1) <= 0.10, (rank, result["comm"], predicted["comm"])
            # and kind by kind, for every kind that carries more than 1% of the traffic
            for kind, nbytes in result["comm"].items():
                if nbytes > 0.01 * sent:
                    assert abs(predicted["comm"].get(kind, 0) / nbytes - 1) <= 0.10, (rank, kind, result["comm"],
                                                                                     predicted["comm"])
