"""`zaya supervise` with real faults: killed and stopped ranks under torchrun, a fake ECC error, NIC flaps,
a crash that repeats, bad input. Each test runs real processes under one deadline."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import zaya
from ranks import run_command, zaya_train
from runs import write_config
from zaya.cli import main
from zaya.errors import EXIT_BAD_INPUT, EXIT_NO_PROGRESS, EXIT_PREEMPTED, EXIT_STOPPED
from zaya.resilience.incidents import read_incidents
from zaya.resilience.processes import descendants, process_state

STEPS = 12
POLICY = """
[supervisor]
poll_s = 0.25
kill_grace_s = 3.0
[heartbeat]
factor = 5.0
floor_s = 3.0
first_timeout_s = 120.0
init_timeout_s = 120.0
"""


def _config(tmp_path: Path, dataset: Path) -> Path:
    return write_config(tmp_path / "run.toml", dataset,
                        train={"max_steps": STEPS, "eval_every": 0, "global_batch_size": 8, "micro_batch_size": 4},
                        checkpoint={"every": 3, "keep": 10}, logging={"record_samples": True},
                        parallel={"timeout_s": 120.0})


def _torchrun(config: Path, run: Path, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "--monitor-interval=0.2", "-m", "zaya.cli", "train", str(config),
            "--run-dir", str(run)]


def _supervise(tmp_path: Path, command: list[str], *, policy: str = POLICY, faults: str = "",
               env: dict | None = None, timeout: float = 400, name: str = "state"):
    policy_file = tmp_path / f"{name}.toml"
    policy_file.write_text(policy)
    state = tmp_path / name
    args = [sys.executable, "-m", "zaya.cli", "supervise", "--policy", str(policy_file), "--state-dir", str(state),
            "--", *command]
    result = run_command(args, timeout=timeout, env={"OMP_NUM_THREADS": "1", "ZAYA_FAULTS": faults, **(env or {})})
    incidents = read_incidents(state / "incidents.jsonl") if (state / "incidents.jsonl").is_file() else []
    return result, state, incidents


def _final_state(run: Path) -> dict:
    return zaya.load_model(run).state_dict()


def _samples(run: Path) -> dict[int, list]:
    """The positions the final trajectory trained at each step (a step run again after a restart counts once)."""
    return {r["step"]: r["positions"] for r in map(json.loads, (run / "samples.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> Path:
    """The same run on 2 ranks, uninterrupted (and unsupervised: the ranks of the session's pool)."""
    tmp = tmp_path_factory.mktemp("reference")
    run = tmp / "run"
    for code, _, err in zaya_train(_config(tmp, dataset), run, 2):
        assert code == 0, err[-5000:]
    assert not (run / "incidents.jsonl").exists()  # a clean run reports nothing
    return run


def _assert_bitwise(run: Path, reference: Path) -> None:
    ours, theirs = _final_state(run), _final_state(reference)
    assert set(ours) == set(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert _samples(run) == _samples(reference)


@pytest.mark.slow
def test_a_killed_rank_and_a_stopped_rank_are_recovered_and_the_run_is_bitwise_the_same(dataset, tmp_path,
                                                                                          reference):
    """Run 0 loses rank 1 to SIGKILL; run 1 has its checkpoint of step 6 damaged once committed and rank 1
    stopped with SIGSTOP (a hang), so run 2 sets that checkpoint aside and resumes from the one before; run 2
    has rank 1 slow."""
    run = tmp_path / "run"
    faults = ("sigkill@step:4@rank=1@run=0,corrupt@committed:6@rank=0@run=1,sigstop@step:8@rank=1@run=1,"
              "slow=0.4@step:10@rank=1@run=2")
    result, _, incidents = _supervise(tmp_path, _torchrun(_config(tmp_path, dataset), run), faults=faults)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    crash, hang = [i for i in incidents if i["event"] == "incident" and i["source"] == "supervisor"]
    assert crash["action"] == "restart" and crash["signal"] == "unknown"  # SIGKILL leaves only cascade lines
    assert hang["signal"] == "hang" and hang["subject"] == "rank:1" and hang["action"] == "restart"
    line = hang["evidence"][0]
    assert "stopped" in line, line
    age = float(line.split("no heartbeat for ")[1].split(" s")[0])
    timeout = float(line.split("(timeout ")[1].split(" s")[0])
    assert timeout <= 10.0 and age <= timeout + 0.25 + 0.5, line  # within the timeout plus one poll
    assert sum(i["event"] == "recovered" for i in incidents) == 2
    assert (run / "checkpoints" / "step_00000006.bad").is_dir()  # kept for a person, never deleted
    resumes = [line.split("resumed from ")[1] for line in (run / "train.log").read_text().splitlines()
               if "resumed from " in line]
    assert [Path(line.split()[0]).name for line in resumes] == ["step_00000003", "step_00000003"], resumes
    # the slowed rank is reported as a straggler, by the trainer, from step 11 on
    slow = [i for i in incidents if i["signal"] == "straggler"]
    assert {i["subject"] for i in slow} == {"rank:1"} and min(i["step"] for i in slow) == 11
    assert all(i["action"] == "log" and i["source"] == "trainer" for i in slow)
    _assert_bitwise(run, reference)


@pytest.mark.slow
def test_an_ecc_error_cordons_that_gpu_and_the_job_restarts_with_one_rank_fewer(tmp_path):
    """The supervisor's side of a cordon, under a real torchrun of stand-in trainers (that a run resumes on fewer
    ranks with the same samples is tests/train/test_distributed.py's chain)."""
    readings = tmp_path / "smi.csv"
    readings.write_text("0, 00000000:3B:00.0, 0, 0\n1, 00000000:5E:00.0, 0, 0\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {readings}\n")
    smi.chmod(0o755)
    policy = POLICY + f'[probes]\ngpu = "nvidia-smi"\nnvidia_smi = ["{smi}"]\n'
    state = tmp_path / "state"
    node = os.uname().nodename

    def break_gpu_one():  # once both ranks of the first run are stepping
        if _both_ranks_reach(state / "heartbeats" / node / "run-0", 5):
            readings.write_text("0, 00000000:3B:00.0, 0, 0\n1, 00000000:5E:00.0, 2, 2\n")

    threading.Thread(target=break_gpu_one, daemon=True).start()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", "--monitor-interval=0.2", str(Path(__file__).with_name("fake_trainer.py")),
               "--steps", "150"]
    result, _, incidents = _supervise(tmp_path, command, policy=policy, timeout=120)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    (ecc,) = [i for i in incidents if i["event"] == "incident"]
    assert ecc["signal"] == "gpu_ecc" and ecc["subject"] == "gpu:1" and ecc["action"] == "cordon_gpu"
    assert json.loads((state / "cordon.json").read_text())["gpus"] == {node: [1]}
    assert "run 1: " in result.stdout and "--nproc-per-node=1" in result.stdout.split("run 1: ")[1].splitlines()[0]
    # the second run is one rank, on the GPU left
    assert sorted(p.name for p in (state / "heartbeats" / node / "run-1").iterdir()) == ["rank-0.json"]


def _both_ranks_reach(beats: Path, step: int, timeout: float = 120.0) -> bool:
    """Wait until the heartbeats of ranks 0 and 1 in `beats` (a run's directory) say `step` or later."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if min(json.loads((beats / f"rank-{r}.json").read_text())["step"] for r in range(2)) >= step:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return False


def _fake_trainer(*args: str) -> list[str]:
    """`zaya train` as the supervisor sees it, without the training (tests/resilience/fake_trainer.py)."""
    return [sys.executable, str(Path(__file__).with_name("fake_trainer.py")), *args]


def _sleeper(seconds: float = 120) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


@pytest.mark.slow
def test_nic_flaps_below_the_threshold_are_logged_and_at_it_the_node_is_cordoned(tmp_path):
    net = tmp_path / "root" / "sys" / "class" / "net" / "eth0"
    net.mkdir(parents=True)
    (net / "operstate").write_text("up\n")
    (net / "carrier_changes").write_text("4\n")
    (net / "device").mkdir()
    policy = POLICY + (f'[probes]\nroot = "{tmp_path / "root"}"\ngpu = "none"\nnics = ["eth0"]\n'
                       '[[rule]]\nsignal = "nic_flap"\nmin_count = 3\naction = "cordon_node"\n')

    def flap():  # once the supervisor has taken its baseline and started the command
        deadline = time.time() + 50
        while not (tmp_path / "state" / "logs" / os.uname().nodename / "run-0.log").exists():
            if time.time() > deadline:
                return
            time.sleep(0.05)
        time.sleep(1)
        (net / "carrier_changes").write_text("6\n")  # 2 changes: below the threshold
        time.sleep(3)
        (net / "carrier_changes").write_text("7\n")  # 3 in all: at it

    threading.Thread(target=flap, daemon=True).start()
    result, state, incidents = _supervise(tmp_path, _sleeper(), policy=policy, timeout=60)
    assert result.returncode == EXIT_STOPPED, result.stdout[-3000:] + result.stderr[-3000:]
    assert [(i["signal"], i["action"]) for i in incidents] == [("nic_flap", "log"), ("nic_flap", "cordon_node")]
    assert json.loads((state / "cordon.json").read_text())["nodes"] == [os.uname().nodename]


def test_a_crash_that_repeats_at_the_same_step_stops_with_the_no_progress_code(tmp_path):
    xid = "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    policy = POLICY.replace("[supervisor]\n", "[supervisor]\nmax_no_progress = 2\n")
    result, _, incidents = _supervise(tmp_path, _fake_trainer("--crash-at", "4", "--line", xid), policy=policy)
    assert result.returncode == EXIT_NO_PROGRESS, result.stdout[-3000:] + result.stderr[-3000:]
    decided = [i for i in incidents if i["event"] == "incident"]
    assert [i["action"] for i in decided] == ["restart", "restart", "stop"]  # run 0 got furthest; 1, 2 did not
    assert all(i["signal"] == "gpu_xid" and "Xid" in i["evidence"][0] for i in decided)
    assert "79" in decided[0]["detail"]


@pytest.mark.parametrize(("policy", "message"), [
    ('[[rule]]\nsignal = "cosmic_ray"\naction = "restart"\n', "unknown signal 'cosmic_ray'"),
    ('[[rule]]\nsignal = "oom"\naction = "reboot"\n', "unknown action 'reboot'"),
    ('[supervisor]\npoll = 1\n', "unknown key 'supervisor.poll'"),
    ('[supervisor]\npoll_s = nan\n', "'supervisor.poll_s' must be a finite number in [0.01, 3600], got nan"),
], ids=["signal", "action", "key", "nan"])
def test_a_bad_policy_is_one_line_and_exit_2(tmp_path, capsys, policy, message):
    (tmp_path / "policy.toml").write_text(policy)
    state = tmp_path / "state"
    code = main(["supervise", "--policy", str(tmp_path / "policy.toml"), "--state-dir", str(state), "--",
                 *_sleeper(1)])
    assert code == EXIT_BAD_INPUT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("zaya: error:") and message in line and "policy.toml" in line
    assert not state.exists()


def test_a_command_that_does_not_exist_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["supervise", "--state-dir", str(tmp_path / "state"), "--", "no-such-trainer", "--flag"])
    assert code == EXIT_BAD_INPUT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "command 'no-such-trainer' not found" in line
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_a_config_mistake_is_bad_input_and_not_restarted(dataset, tmp_path):
    config = write_config(tmp_path / "run.toml", dataset, train={"global_batch_size": 9, "micro_batch_size": 4,
                                                                 "max_steps": 4})
    command = [sys.executable, "-m", "zaya.cli", "train", str(config), "--run-dir", str(tmp_path / "run")]
    result, _, incidents = _supervise(tmp_path, command, timeout=120)
    assert result.returncode == EXIT_BAD_INPUT, result.stdout[-3000:]
    (stop,) = incidents
    assert stop["action"] == "stop" and "zaya: error" in stop["evidence"][0] and "micro_batch_size" in \
        stop["evidence"][0]


def test_a_killed_supervisor_takes_its_group_with_it(tmp_path):
    state = tmp_path / "state"
    supervisor = subprocess.Popen([sys.executable, "-m", "zaya.cli", "supervise", "--state-dir", str(state), "--",
                                   *_sleeper(60)], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        children = []
        while not children and time.time() < deadline:
            children = descendants(supervisor.pid)
            time.sleep(0.1)
        assert children, "the supervisor did not start its command"
        supervisor.kill()
        supervisor.wait()
        deadline = time.time() + 10
        while any(process_state(pid) not in (None, "Z") for pid in children) and time.time() < deadline:
            time.sleep(0.05)
        assert all(process_state(pid) in (None, "Z") for pid in children)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


@pytest.mark.slow
def test_a_hang_the_policy_only_logs_is_recorded_once_and_the_run_goes_on(tmp_path):
    policy = ('[supervisor]\npoll_s = 0.1\n[heartbeat]\ninit_timeout_s = 0.5\n'
              '[[rule]]\nsignal = "hang"\naction = "log"\n')
    result, _, incidents = _supervise(tmp_path, _sleeper(3), policy=policy, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:]
    (logged,) = incidents  # the command never writes a heartbeat: an init hang at every poll after 0.5 s
    assert logged["signal"] == "hang" and logged["action"] == "log" and "no rank wrote a heartbeat" in \
        logged["evidence"][0]


@pytest.mark.slow
def test_a_stopped_supervisor_passes_the_signal_on_and_the_trainers_stop_with_a_checkpoint(tmp_path):
    """What a scheduler does before its time limit: SIGTERM to the supervisor, which passes it on to the group,
    here stand-in trainers under a real torchrun. (That a real trainer then ends its step, checkpoints and
    resumes bitwise is tests/train/test_preemption.py's, and that torchrun hands its workers a signal too.)"""
    state = tmp_path / "state"
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    node = os.uname().nodename
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", "--monitor-interval=0.2", str(Path(__file__).with_name("fake_trainer.py")),
               "--steps", "5000"]
    args = [sys.executable, "-m", "zaya.cli", "supervise", "--policy", str(policy), "--state-dir", str(state), "--",
            *command]
    supervisor = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        _both_ranks_reach(state / "heartbeats" / node / "run-0", 3)
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=120)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert supervisor.returncode == 128 + signal.SIGTERM, out[-4000:]
    log = (state / "logs" / node / "run-0.log").read_text()
    assert log.count("stopped at step") == 2 and "(SIGTERM); exit code 75" in log, log[-3000:]  # both ranks
    assert "run 1: " not in out  # stopped, not restarted


def test_a_run_that_stops_for_its_time_limit_is_not_restarted(tmp_path):
    result, _, incidents = _supervise(tmp_path, _fake_trainer("--stop-at", "3"), timeout=60)
    assert result.returncode == EXIT_PREEMPTED, result.stdout[-3000:] + result.stderr[-3000:]
    assert incidents == [] and "stopped early with a checkpoint" in result.stdout


def test_heartbeats_the_supervisor_did_not_cause_are_never_trusted(tmp_path):
    # a process of someone else's, named in a heartbeat that looks hung: the supervisor stops its own group and
    # signals nothing else; malformed heartbeat files beside it are ignored, not a crash
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        policy = POLICY + '[[rule]]\nsignal = "hang"\naction = "stop"\n'
        result, _, incidents = _supervise(tmp_path, _fake_trainer("--spoof-pid", str(foreign.pid)), policy=policy,
                                          timeout=120)
        assert result.returncode == EXIT_STOPPED, result.stdout[-3000:]
        (stopped,) = incidents
        assert stopped["signal"] == "hang" and f"process {foreign.pid}" in stopped["evidence"][0]
        assert "Traceback" not in result.stdout
        assert process_state(foreign.pid) in ("S", "R")  # alive: not ours to kill
    finally:
        foreign.kill()
        foreign.wait()


@pytest.mark.parametrize("node", ["../../x", "a/b", ".."])
def test_a_node_name_that_is_not_a_plain_name_is_one_line(tmp_path, capsys, node):
    code = main(["supervise", "--state-dir", str(tmp_path / "state"), "--node", node, "--", *_sleeper(1)])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "a node name is letters, digits" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "state" / "heartbeats").exists()
