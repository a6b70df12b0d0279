"""The trainer's own training signals: a non-finite step is skipped, a loss spike rolls back and its data is
never trained on; incidents are recorded."""

import json

import torch

from runs import checkpoint_tensors, write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.resilience.incidents import read_incidents
from zaya.resilience.policy import TrainingSettings
from zaya.resilience.signals import SpikeDetector, as_ranges, straggler
from zaya.run_dir import SAMPLES_FILE
from zaya.train.metrics import read_metrics
from zaya.training import build_trainer


def test_a_nan_step_is_skipped_and_changes_nothing(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 8},
                          checkpoint={"every": 1, "keep": 10})
    run = tmp_path / "run"
    build_trainer(load_config(config), run, environ={"ZAYA_FAULTS": "nan@step:5"}).run()
    rows = {row["step"]: row for row in read_metrics(run)}
    assert rows[6]["skipped"] and not any(rows[s]["skipped"] for s in rows if s != 6)
    before, after = (checkpoint_tensors(run / "checkpoints" / f"step_{step:08d}") for step in (5, 6))
    assert any(k.startswith("optim.") for k in before) and set(before) == set(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    changed = checkpoint_tensors(run / "checkpoints" / "step_00000007")
    assert not all(torch.equal(after[k], changed[k]) for k in after if k.startswith("model."))
    state = ckpt.read_json(run / "checkpoints" / "step_00000006" / ckpt.TRAIN_STATE_FILE)["state"]
    assert state["step"] == 6 and state["samples"] == 6 * 8  # the step and its samples still count
    (incident,) = read_incidents(run / "incidents.jsonl")
    assert incident["signal"] == "nan" and incident["action"] == "skip_step" and incident["source"] == "trainer"


def test_a_loss_spike_rolls_back_and_its_samples_are_never_trained(dataset, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[training]\nspike_min_history = 3\nspike_window = 5\nspike_ratio = 3.0\n")
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 10, "eval_every": 0},
                          logging={"record_samples": True})
    run = tmp_path / "run"
    environ = {"ZAYA_POLICY": str(policy), "ZAYA_FAULTS": "spike=50@step:7"}
    build_trainer(load_config(config), run, environ=environ).run()

    records = [json.loads(line) for line in (run / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10]  # back to checkpoint 6 at 8
    spiked = records[7]["positions"]  # step 8's data: the spike
    final = {r["step"]: r["positions"] for r in records}  # the last time each step was trained
    trained = {p for runs in final.values() for a, b in runs for p in range(a, b)}
    skipped = {p for a, b in spiked for p in range(a, b)}
    assert len(skipped) == 8 and not trained & skipped
    assert final[7] == records[6]["positions"]  # the replayed step before the spike trains the same data
    assert len(trained) == 10 * 8
    incidents = read_incidents(run / "incidents.jsonl")
    (spike,) = [i for i in incidents if i["signal"] == "loss_spike"]
    assert spike["action"] == "rollback" and "rolled back to step 6" in spike["outcome"]
    saved = ckpt.read_json(run / "checkpoints" / "step_00000009" / ckpt.TRAIN_STATE_FILE)["state"]
    (loader,) = saved["loaders"].values()
    assert [list(r) for r in loader["skip_ranges"]] == spiked  # the skip range is in every later checkpoint
    assert max(row["step"] for row in read_metrics(run)) == 10
    assert all(row["loss"] < 20 for row in read_metrics(run))  # the spiked row was rolled back with the metrics


def test_spike_detector_judges_against_the_recent_median():
    detector = SpikeDetector(TrainingSettings(spike_ratio=1.5, spike_window=4, spike_min_history=3))
    assert [detector.check(s, v) for s, v in enumerate([9.0, 6.0, 5.0])] == [None] * 3  # history
    assert detector.check(3, 4.0) is None  # falling loss: never a spike
    assert detector.check(4, 8.0) is None  # 8 <= 1.5 x 5.5
    finding = detector.check(5, 9.0)
    assert finding is not None and finding.signal == "loss_spike" and "median 5.5000" in finding.line
    assert detector.check(6, 5.0) is None  # the spike did not join the history
    assert list(detector.history) == [5.0, 4.0, 8.0, 5.0]


def test_straggler_is_the_rank_whose_own_time_stands_out():
    settings = TrainingSettings(straggler_ratio=1.5, straggler_min_s=0.05)
    assert straggler(3, [0.01, 0.012, 0.011], settings) is None
    assert straggler(3, [0.001, 0.002], settings) is None  # 2x, but by under 50 ms
    finding = straggler(3, [0.01, 0.5, 0.012, 0.011], settings)
    assert finding.subject == "rank:1" and "rank 1 took 0.500 s" in finding.line


def test_positions_become_ranges():
    assert as_ranges([5, 3, 4, 9, 10, 0]) == [[0, 1], [3, 6], [9, 11]]
    assert as_ranges([]) == []


def test_a_processs_first_step_is_its_warm_up_not_a_straggler(tmp_path):
    """The first step a process watches (after a start or a resume: the data's first reads, state built on first
    use) is not judged for stragglers; the same host times on the next step are."""
    from zaya.resilience.incidents import IncidentLog
    from zaya.resilience.policy import Policy
    from zaya.train.signals import TrainingSignals

    said = []
    signals = TrainingSignals(Policy(), IncidentLog(tmp_path / "incidents.jsonl"), attempt=0, is_main=True,
                              say=said.append)
    row = {"skipped": False, "loss": 2.0, "host_time": [0.007, 0.2], "expert_load": [[0.5, 0.5]]}
    signals.watch(4, row)
    assert not said
    signals.watch(5, row)
    assert len(said) == 1 and "step 5: rank 1 took 0.200 s of host time" in said[0]
