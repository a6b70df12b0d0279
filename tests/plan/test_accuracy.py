"""The planner against real runs on gloo ranks of this machine: state bytes per rank within 5%, activation
memory within 20% (the bytes autograd saves, `zaya.plan.measure`), bytes sent per step within 10% by
collective, and, with the table `zaya shapes` measures here, one process's step time within 25%."""

from __future__ import annotations

import pytest
import torch

from ranks import run_distributed
from zaya.cli import main
from zaya.plan.compare import ACCURACY_CASES, TIME_CASES, Case, predicted_step
from zaya.plan.measure import measured_step
from zaya.plan.shapes import EfficiencyTable

pytestmark = pytest.mark.slow

CASES = ACCURACY_CASES


def _measure(rank: int, world: int, kwargs: dict) -> dict:
    return measured_step(**kwargs, steps=1)


def _id(case: Case) -> str:
    extra = f"-hsdp{case.dp_replicate}" if case.dp_replicate > 1 else ""
    extra += f"-cp{case.cp}-{case.cp_kernel}" if case.cp > 1 else ""
    extra += f"-ac-{case.activation_checkpointing}" if case.activation_checkpointing != "none" else ""
    return f"{case.preset}-{case.precision}-{case.world}rank{extra}"


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


def _one_process(rank: int, world: int, kwargs: dict) -> dict:
    return measured_step(**kwargs, steps=5)


@pytest.fixture(scope="module")
def local_tables(tmp_path_factory):
    """The tables `zaya shapes` measures here for the presets the step times are predicted for."""
    tables = {}
    for preset in ("tiny", "small"):
        path = tmp_path_factory.mktemp("shapes") / f"{preset}.json"
        assert main(["shapes", "--preset", preset, "--dtype", "fp32", "--tokens", "1024", "--out", str(path),
                     "--no-progress", "--budget-s", "40"]) == 0
        tables[preset] = EfficiencyTable.load(path)
    return tables


@pytest.mark.parametrize("case", TIME_CASES, ids=[case.preset for case in TIME_CASES])
def test_predicted_step_time_is_within_a_quarter_of_the_measured_one(case, local_tables, capsys):
    table = local_tables[case.preset]
    capsys.readouterr()
    measured = run_distributed(_one_process, 1, case.measure_kwargs(), timeout=900,
                               threads=torch.get_num_threads())[0]["seconds"]
    predicted = predicted_step(case, table=table)["seconds"]
    assert abs(predicted / measured - 1) <= 0.25, (predicted, measured)
