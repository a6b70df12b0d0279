"""What a run tells the people who run it: a line per logged step in a batch job's log, and experts that collapse
warned about, recorded as an incident and listed by the report; the default recipe keeps the demo's model from
collapsing at lr 0.01."""

import pytest

from runs import write_config, zaya_command
from zaya.config import load_config
from zaya.report.report import build_report, read_all_incidents
from zaya.resilience.policy import TrainingSettings
from zaya.train.log import RunLog
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def test_a_batch_job_log_has_a_line_per_logged_step(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 4, "eval_every": 4},
                          logging={"log_every": 2})
    # the output is not a terminal; the model has more embedding rows than the data has tokens
    code, out, err = zaya_command(["train", config, "--run-dir", tmp_path / "run", "--set", "model.vocab_size=1024"])
    assert code == 0, err
    assert "warning: model.vocab_size is 1024, but the data's tokenizer has 400 tokens" in out
    assert "624 embedding rows will never be trained; set model.vocab_size = 512" in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"], out
    for field in ("loss ", "lr ", " tok/s", "MFU ", "grad norm ", "expert imbalance ", "ETA "):
        assert all(field in line for line in lines), (field, lines)
    assert "eval loss " in lines[1] and "eval loss" not in lines[0]
    assert lines[1].endswith("ETA 0:00:00")
    log = (tmp_path / "run" / "train.log").read_text()
    assert all(line in log for line in lines)


def test_a_line_kept_off_the_screen_still_goes_to_the_log(tmp_path, capsys):
    log = RunLog(tmp_path, 0)
    log("shown")
    log("only logged", show=False)
    assert capsys.readouterr().out == "shown\n"
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith(" only logged")


def _first_collapse(rows: list[dict], settings: TrainingSettings) -> int | None:
    """The step at which some layer has been above the ratio in `collapse_steps` logged steps in a row."""
    layers = len(rows[0]["expert_imbalance"])
    in_row = [0] * layers
    for row in rows:
        for layer, ratio in enumerate(row["expert_imbalance"]):
            in_row[layer] = in_row[layer] + 1 if ratio > settings.collapse_ratio else 0
        if max(in_row) >= settings.collapse_steps:
            return row["step"]
    return None


@pytest.mark.slow
def test_experts_that_collapse_are_warned_about_recorded_and_reported(dataset, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[training]\ncollapse_steps = 3\ncollapse_ratio = 2.5\n")
    settings = TrainingSettings(collapse_steps=3, collapse_ratio=2.5)
    # no balancing and a learning rate far too high: the routers send their tokens to one expert
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 12, "eval_every": 0},
                          optim={"lr": 0.1}, balance={"enabled": False})
    run = tmp_path / "run"
    build_trainer(load_config(config), run, environ={"ZAYA_POLICY": str(policy)}).run()
    rows = read_metrics(run)
    assert _first_collapse(rows, settings) is not None, [row["expert_imbalance"] for row in rows]
    incidents = [i for i in read_all_incidents(run) if i["signal"] == "expert_collapse"]
    assert incidents and incidents[0]["action"] == "log"
    # the warning judges each expert's load averaged over the last collapse_steps steps (the metrics log each
    # step's own imbalance): the layer it names was above the ratio within that window, and not before a full one
    step, layer = incidents[0]["step"], int(incidents[0]["subject"].split(":")[1])
    window = [row["expert_imbalance"][layer] for row in rows if step - settings.collapse_steps < row["step"] <= step]
    assert step >= settings.collapse_steps and max(window) > settings.collapse_ratio, (step, window)
    assert f"warning: step {step}: experts collapsing in MoE layer" in (run / "train.log").read_text()
    summary = build_report(run).summary
    assert summary.warnings and summary.warnings[0] == incidents[0]["evidence"][0]


@pytest.mark.slow
def test_the_default_recipe_keeps_the_demo_model_at_lr_0_01_from_collapsing(dataset, tmp_path):
    """The demo's model (`tiny` with d = 192 and 4 experts) at lr 0.01 with the default balancing gain: with the
    vectors at AdamW's full rate (the recipe before `optim.vector_lr_ratio`) every layer soon sends all its tokens
    to one expert; at the default ratio they do not, and the loss is lower. (That the collapse warning and
    incident follow from such loads is the test above.)"""
    settings = TrainingSettings(collapse_steps=10)  # 3.0 x the mean load in 10 steps in a row (default: 20)
    outcomes = {}
    for ratio in (1.0, None):
        optim = {"lr": 0.01} if ratio is None else {"lr": 0.01, "vector_lr_ratio": ratio}
        config = write_config(tmp_path / f"{ratio}.toml", dataset,
                              model={"preset": "tiny", "hidden_size": 192, "head_dim": 24, "num_experts": 4},
                              data={"seq_len": 64}, optim=optim, schedule={"warmup_steps": 20},
                              train={"max_steps": 30, "eval_every": 0, "seed": 0, "micro_batch_size": 8,
                                     "global_batch_size": 8},
                              checkpoint={"every": 100})
        run = tmp_path / f"run-{ratio}"
        build_trainer(load_config(config), run).run()
        rows = read_metrics(run)
        outcomes[ratio] = (_first_collapse(rows, settings), rows[-1]["loss"],
                           [max(row["expert_imbalance"]) for row in rows])
    step, before, loads = outcomes[1.0]
    assert step is not None and min(loads[-10:]) >= 3.5, loads  # measured 4.0: every token to one expert
    step, after, loads = outcomes[None]
    assert step is None and max(loads[-10:]) < 3.5, loads  # measured 2.2-2.8
    assert after < before - 0.1
