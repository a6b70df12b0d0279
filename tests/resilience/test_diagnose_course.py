"""`zaya diagnose` on a run's own log: a run that completed says so (its step, exit code 0), one stopped on
purpose (a signal, Ctrl-C) is `stopped` and resumable, not an uncaught exception, and a failed one names its
failure, never `unknown` for all three. The logs are real runs' where a run can make them, torchrun's and
Python's own lines otherwise."""

from __future__ import annotations

import pytest

from runs import write_config, zaya_command
from zaya.config import load_config
from zaya.resilience.diagnose import ROOT_CLASSES, _Classifier, _strip_prefixes, classify_files, classify_text
from zaya.resilience.policy import SIGNALS
from zaya.resilience.signatures import _RULES, COURSE, _triggered
from zaya.training import build_trainer

START = "2026-01-05 10:00:00 training on cpu (cpu), fp32, full sharding; mesh dp_replicate 1 x dp_shard 1"
STEP = "2026-01-05 10:00:01 step {}/40 | loss 5.1543 | lr 0.01 | 3,545 tok/s | MFU 2.7% | grad norm 2.23 | ETA 0:00:09"
FINISHED = "2026-01-05 10:00:09 finished at step 40: the run is complete"
STOPPING = "2026-01-05 10:00:05 stopping at step 7 on SIGTERM: checkpoint step 7 is committed; the same command " \
    "resumes from it"
NAN = "2026-01-05 10:00:04 incident: step 3: non-finite gradient norm (nan); loss or gradients are NaN or inf -> " \
    "skip_step: update dropped, step counted"
SIGNAL_EXCEPTION = """\
Traceback (most recent call last):
  File "/usr/local/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 277, in launch_agent
    result = agent.run()
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in \
_terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 2"""
KEYBOARD_INTERRUPT = """\
Traceback (most recent call last):
  File "/workspace/train.py", line 88, in <module>
    loss.backward()
KeyboardInterrupt"""

COURSE_SAMPLES = [
    ("unknown", START),  # alone, a start and a step are no end
    ("unknown", STEP.format(5)),
    ("completed", FINISHED),
    ("completed", 'done: {"step": 40, "loss": 4.98, "eval_loss": 5.02, "tokens": 10240}; run directory runs/x'),
    ("stopped", STOPPING),
    ("stopped", "stopped at step 7 (SIGINT); exit code 75: resubmit the same command to resume; run directory r"),
    ("stopped", "zaya: aborted"),
    ("stopped", "2026-01-05 10:00:05 aborted by a second Ctrl-C (SIGINT): the step in progress is lost; the last "
                "committed checkpoint is kept, and the same command resumes from it"),
    ("stopped", "KeyboardInterrupt"),
    ("stopped", "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15"),
    ("stopped", "W1205 03:21:06.287000 12419 torch/distributed/elastic/agent/server/api.py:753] Received "
                "Signals.SIGINT death signal, shutting down workers"),
    ("stopped", "zaya launch: SIGTERM: passed on to the workers, which have ended; exit code 143"),
]


@pytest.mark.parametrize("expected, line", COURSE_SAMPLES, ids=[f"{i}-{c}" for i, (c, _) in enumerate(COURSE_SAMPLES)])
def test_each_line_of_a_runs_course(expected, line):
    diagnosis = classify_text(line)
    assert diagnosis.root == expected, diagnosis
    assert diagnosis.line == ("" if expected == "unknown" else line) and "?" not in diagnosis.detail


def test_a_policy_rule_may_name_every_class():
    assert set(ROOT_CLASSES) <= set(SIGNALS)


def test_every_course_rule_has_a_sample():
    bodies = [_strip_prefixes(line)[0] for _, line in COURSE_SAMPLES]  # the run log's stamp off
    matched = {_RULES.index(_Classifier._match(_triggered(body.lower()), body)[0]) for body in bodies}
    assert [rule.regex.pattern for i, rule in enumerate(_RULES) if rule.root in COURSE and i not in matched] == []


@pytest.mark.parametrize("lines, root, fragment", [
    # what failed before the run's end is history: a skipped NaN step, then the run went on and finished
    ([START, NAN, STEP.format(39), FINISHED], "completed", "finished at step 40 (exit code 0)"),
    # stopped, resumed, and then it failed: the failure
    ([START, STOPPING, START, STEP.format(8), NAN], "nan", "non-finite"),
    # stopped, resumed, and nothing since: neither the old stop nor a failure, and said so
    ([START, STOPPING, START, STEP.format(9)], "unknown", "last step logged is 9"),
    # a failure after the end (a crash at exit) is the diagnosis
    ([START, FINISHED, "2026-01-05 10:00:10 zaya: error: storage full"], "python", "storage full"),
    # torchrun's Ctrl-C traceback is a stop, not an uncaught exception; so is Python's
    ([START, STEP.format(3), SIGNAL_EXCEPTION], "stopped", "got SIGINT (Ctrl-C)"),
    ([KEYBOARD_INTERRUPT], "stopped", "aborted by Ctrl-C"),
    # the launcher's stop, then the trainers': the trainers' line (with its step) is the news
    (["Received 15 death signal, shutting down workers", STOPPING, SIGNAL_EXCEPTION], "stopped",
     "at step 7 on SIGTERM"),
    # a bug's own line, as a run's log ends with it (the traceback went to the screen)
    ([START, STEP.format(3), "2026-01-05 10:00:04 InjectedFault: injected fault at step 3"], "python",
     "uncaught InjectedFault: injected fault at step 3"),
])
def test_the_runs_course_against_its_failures(lines, root, fragment):
    diagnosis = classify_text("\n".join(lines))
    assert diagnosis.root == root and fragment in diagnosis.detail, diagnosis


def test_a_stopped_run_says_so_and_once_resumed_to_its_end_that_it_completed(dataset, tmp_path, capsys):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 5}))
    build_trainer(config, tmp_path / "run", environ={"ZAYA_FAULTS": "sigterm@step:2"}).run()
    diagnosis = classify_files([tmp_path / "run" / "train.log"])
    assert (diagnosis.root, diagnosis.detail) == ("stopped", "the run stopped at step 3 on SIGTERM with a checkpoint "
                                                  "of that step (exit code 75): the same command resumes it")
    build_trainer(config, tmp_path / "run").run()
    capsys.readouterr()
    code, out, _ = zaya_command(["diagnose", tmp_path / "run" / "train.log"])
    assert code == 0 and out.startswith("completed: the run finished at step 5 (exit code 0) at "), out


def test_a_failed_run_names_its_failure(dataset, tmp_path, monkeypatch):
    """Its last step's update was dropped (NaN): the run ends with an error, and its log with the NaN."""
    config = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 4})
    monkeypatch.setenv("ZAYA_FAULTS", "nan@step:3")
    code, out, err = zaya_command(["train", config, "--run-dir", tmp_path / "run"])
    assert code == 2 and "non-finite" in err
    (tmp_path / "printed.txt").write_text(out + err)  # what `zaya train > printed.txt 2>&1` keeps
    for log in (tmp_path / "run" / "train.log", tmp_path / "printed.txt"):
        diagnosis = classify_files([log])
        assert (diagnosis.root, diagnosis.detail) == ("nan", "non-finite loss or gradient"), (log, diagnosis)
