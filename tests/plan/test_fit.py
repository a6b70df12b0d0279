"""`zaya.plan.fit`: a run the plan says does not fit its device is described in one line (its largest part, the
smallest fix); a CPU's plan speaks of CPU processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zaya.config import load_config
from zaya.plan.devices import get_device
from zaya.plan.fit import largest_part, memory_problem
from zaya.plan.plan_cli import format_plan
from zaya.plan.planner import plan_run

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "configs" / "small.toml"


def _run(*overrides: str):
    return load_config(SMALL, ["data.seq_len=2048", "train.micro_batch_size=8", "train.global_batch_size=64",
                               *overrides]).resolve(1, "bf16")


def _device(memory_bytes: int, host: bool = False):
    return dataclasses.replace(get_device("h100"), memory_bytes=memory_bytes, host=host)


def test_a_run_that_fits_has_no_problem():
    run = _run()
    plan = plan_run(run, get_device("h100"))
    assert plan.fits and memory_problem(plan, run) is None


def test_the_smallest_fix_changes_the_fewest_settings():
    run = _run()
    needs = plan_run(run, get_device("h100")).first.memory.total
    # room for the same layout with a micro-batch of one, not for the micro-batch of eight
    lean = plan_run(_run("train.micro_batch_size=1"), get_device("h100")).first.memory.total
    device = _device((needs + lean) // 2)
    plan = plan_run(run, device)
    part, nbytes = largest_part(plan.first)
    assert part == "activations" and nbytes == plan.first.memory.activations
    problem = memory_problem(plan, run)
    assert problem.startswith(f"{SMALL}: the plan needs {needs / 1e9:.2f} GB per GPU (the largest part: "
                              f"activations {nbytes / 1e9:.2f} GB), more than the {device.memory_bytes / 1e9:.2f} GB "
                              "the h100 has; ")
    fix = problem.split("; ", 1)[1]
    assert fix.startswith("--set ") and fix.count("--set ") == 1, fix  # one setting suffices
    changed = fix.split(" makes it ")[0].removeprefix("--set ")
    fixed = plan_run(_run(changed), device)
    assert fixed.fits and f"makes it {fixed.first.memory.total / 1e9:.2f} GB" in fix


@pytest.mark.parametrize(("host", "said"), [(False, "more GPUs, shorter sequences"), (True, "fits: shorter sequences")])
def test_where_no_layout_fits_the_line_says_what_else_would(host, said):
    run = _run()
    plan = plan_run(run, _device(10**6, host))
    problem = memory_problem(plan, run)
    assert f"per {'CPU process' if host else 'GPU'}" in problem and "no layout of its 1 rank(s) fits" in problem
    assert said in problem and f"zaya plan {SMALL} --search" in problem
    assert memory_problem(plan_run(run, _device(0, host)), run) is None  # memory unknown: no verdict


def test_the_plan_of_a_cpu_speaks_of_cpu_processes():
    run = _run()
    text = format_plan(plan_run(run, _device(10**12, host=True)))
    assert "memory per CPU process" in text and "tokens/s per CPU process" in text and "per GPU" not in text
    assert "memory per GPU" in format_plan(plan_run(run, get_device("h100")))
