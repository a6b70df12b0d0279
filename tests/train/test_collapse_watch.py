"""The expert-collapse warning judges the load averaged over `collapse_steps` steps: a router that sends every token
to one expert is reported, the start of a healthy run (whose busiest expert changes from step to step) is not."""

import pytest

from runs import write_config
from zaya.config import load_config
from zaya.report.report import read_all_incidents
from zaya.resilience.policy import TrainingSettings
from zaya.resilience.signals import CollapseWatch
from zaya.train.hooks import Hooks
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def _on_one(experts: int, busiest: int, share: float) -> list[float]:
    """A layer's load with `share` of the tokens on expert `busiest` and the rest spread evenly."""
    rest = (1.0 - share) / (experts - 1)
    return [share if expert == busiest else rest for expert in range(experts)]


def test_a_layer_on_one_expert_is_reported_once_after_the_window_and_again_after_it_recovered():
    watch = CollapseWatch(TrainingSettings(collapse_ratio=3.0, collapse_steps=4))
    balanced, collapsed = _on_one(4, 0, 0.25), _on_one(4, 2, 1.0)
    steps = [[collapsed, balanced]] * 6 + [[balanced, balanced]] * 12 + [[collapsed, collapsed]] * 6
    seen = {step: finding for step, layers in enumerate(steps) if (finding := watch.check(step, layers))}
    # the first full window; then, after both recovered, the moving average passes 3.0 on the fourth collapsed step
    assert list(seen) == [3, 21]
    assert seen[3].signal == "expert_collapse" and seen[3].subject == "layer:0" and seen[3].count == 1
    assert "MoE layer 0:" in seen[3].line and "3 x the mean load over the last 4 steps (4.00 x)" in seen[3].line
    assert seen[21].count == 2 and "layers 0, 1:" in seen[21].line


def test_a_load_handed_from_expert_to_expert_is_no_collapse():
    """The start of a small run: most of each step's tokens on one expert, another one every step."""
    settings = TrainingSettings()
    watch = CollapseWatch(settings)
    for step in range(60):
        layers = [_on_one(8, (step * 3 + layer) % 8, 0.6) for layer in range(4)]
        assert max(layers[0]) * 8 > settings.collapse_ratio  # 4.8 x the mean in every step
        assert watch.check(step, layers) is None
    assert max(watch.imbalance()) < 1.5


def test_a_new_shape_starts_a_new_window():
    watch = CollapseWatch(TrainingSettings(collapse_steps=3))
    assert [watch.check(step, [_on_one(4, 0, 1.0)]) for step in range(2)] == [None, None]
    assert [watch.check(step, [_on_one(8, 0, 1.0)]) for step in range(2, 4)] == [None, None]
    assert watch.check(4, [_on_one(8, 0, 1.0)]).line.endswith("(8.00 x)")


# healthy 40-step runs at the learning rates of the docs: the default, the README's and small.toml's, the demo's
HEALTHY = {
    "micro (4 experts), lr 0.016": ({"preset": "micro"}, 0.016),
    "8 experts, lr 0.003": ({"preset": "micro", "num_experts": 8, "moe_intermediate_size": 32}, 0.003),
    "16 experts, lr 0.001": ({"preset": "micro", "num_experts": 16, "moe_intermediate_size": 16}, 0.001),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_a_healthy_short_run_gives_no_collapse_warning(dataset, tmp_path, name):
    model, lr = HEALTHY[name]
    config = write_config(tmp_path / "run.toml", dataset, model=model, optim={"lr": lr},
                          train={"max_steps": 40, "eval_every": 0, "micro_batch_size": 8, "global_batch_size": 8},
                          schedule={"warmup_steps": 0}, checkpoint={"every": 100})
    run = tmp_path / "run"
    build_trainer(load_config(config), run).run()
    rows = read_metrics(run)
    assert len(rows) == 40
    watch = CollapseWatch(TrainingSettings())
    for row in rows:
        watch.check(row["step"], row["expert_load"])
    assert max(watch.imbalance()) < TrainingSettings().collapse_ratio, watch.imbalance()
    assert [i for i in read_all_incidents(run) if i["signal"] == "expert_collapse"] == []
    assert "experts collapsing" not in (run / "train.log").read_text()


def test_a_router_forced_to_one_expert_is_warned_about(dataset, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[training]\ncollapse_steps = 4\n")
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6, "eval_every": 0},
                          balance={"enabled": False}, checkpoint={"every": 100})
    run = tmp_path / "run"

    def force(event, step, path=None):
        if event == "step":  # expert 0's bias beats any difference of probabilities: every token goes there
            for block in trainer.model.blocks:
                block.moe.router.balancing_biases[0] = 1.0

    trainer = build_trainer(load_config(config), run, environ={"ZAYA_POLICY": str(policy)}, hooks=Hooks([force]))
    trainer.run()
    assert all(load[0] == 1.0 for row in read_metrics(run) for load in row["expert_load"])
    incidents = [i for i in read_all_incidents(run) if i["signal"] == "expert_collapse"]
    assert [(i["step"], i["action"]) for i in incidents] == [(4, "log")], incidents
    assert ("warning: step 4: experts collapsing in MoE layers 0, 1, 2: the busiest expert took more than 3 x the "
            "mean load over the last 4 steps (4.00 x)") in (run / "train.log").read_text()
