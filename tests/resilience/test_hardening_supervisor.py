"""The supervisor, `zaya diagnose` and their files against hostile input: FIFOs, devices and links where files go,
absurd sizes and numbers, values of the wrong type, lines of megabytes, and workers that leave children behind.
Each is one line, a bounded read, or ignored with a note; nothing blocks and nothing outlives its run."""

from __future__ import annotations

import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from zaya.errors import EXIT_EXHAUSTED, EXIT_OK, ZayaError
from zaya.resilience.command import WorkerCommand
from zaya.resilience.diagnose import classify_lines
from zaya.resilience.gpu_probe import GpuProbe
from zaya.resilience.heartbeat import Heartbeat
from zaya.resilience.incidents import IncidentLog, read_incidents
from zaya.resilience.output import LINE_CAP, TAIL_LINE, GroupOutput
from zaya.resilience.policy import Policy
from zaya.resilience.probe_config import ProbeConfig
from zaya.resilience.probes import NicProbe
from zaya.resilience.processes import process_state
from zaya.resilience.readings import ReadError, run_command
from zaya.resilience.supervisor import Supervisor

NODE = "n0"
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def _one_line(cli, args, match: str) -> str:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), (args, err)
    assert match in lines[0], (match, lines[0])
    return lines[0]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _policy(tmp_path: Path, text: str = "") -> Policy:
    path = tmp_path / "policy.toml"
    path.write_text("[supervisor]\npoll_s = 0.05\nkill_grace_s = 2.0\nmax_restarts = 0\n[probes]\ngpu = 'none'\n"
                    f"root = '{tmp_path / 'root'}'\n" + text)
    return Policy.load(path)


# ---- files that are not regular files, and paths that cannot be -------------------------------------------


@pytest.mark.parametrize("case", ["policy-fifo", "policy-device", "log-fifo", "log-device"])
def test_inputs_that_are_not_regular_files_are_one_line(cli, tmp_path, case):
    state = ["--state-dir", tmp_path / "state"]
    worker = ["--", *_python("pass")]
    args, match = {
        "policy-fifo": (["supervise", "--policy", _fifo(tmp_path / "p.toml"), *state, *worker], "a FIFO"),
        "policy-device": (["supervise", "--policy", "/dev/zero", *state, *worker], "not a regular file"),
        "log-fifo": (["diagnose", _fifo(tmp_path / "w.log")], "a FIFO, not a regular file"),
        "log-device": (["diagnose", "/dev/urandom"], "a character device, not a regular file"),
    }[case]
    _one_line(cli, args, match)
    assert not (tmp_path / "state").exists()


def _plant(state: Path, case: str, tmp_path: Path) -> str:
    """Plant `case` in the state directory; returns what the one line must say."""
    logs, beats = state / "logs" / NODE, state / "heartbeats" / NODE
    if case == "incidents-fifo":
        _fifo(state / "incidents.jsonl")
        return "incidents.jsonl: a FIFO, not a regular file"
    if case == "incidents-link":
        (state / "incidents.jsonl").symlink_to(tmp_path / "user.txt")
        return "incidents.jsonl: a symbolic link, not a regular file"
    if case == "cordon-fifo":
        _fifo(state / "cordon.json")
        return "cordon.json: a FIFO, not a regular file"
    if case == "cordon-device":
        (state / "cordon.json").symlink_to("/dev/zero")
        return "cordon.json: a symbolic link, not a regular file"
    if case.startswith("cordon-"):
        text, match = {"cordon-gpus": ('{"gpus": {"n0": ["x"]}}', "field 'gpus.n0.0' must be a GPU index"),
                       "cordon-nodes": ('{"nodes": "n0"}', "field 'nodes' must be a list"),
                       "cordon-list": ("[1, 2]", "expected a JSON object"),
                       "cordon-deep": ('{"a": ' + "[" * 100 + "]" * 100 + "}", "nested more than 64 deep")}[case]
        (state / "cordon.json").write_text(text)
        return f"cordon.json: {match}"
    if case == "log-fifo":
        logs.mkdir(parents=True)
        _fifo(logs / "run-0.log")
        return "run-0.log: a FIFO, not a regular file"
    if case == "logs-link":
        (state / "logs").mkdir()
        (tmp_path / "user").mkdir(exist_ok=True)
        logs.symlink_to(tmp_path / "user")
        return f"logs/{NODE}: a symbolic link, not a directory"
    beats.mkdir(parents=True)
    _fifo(beats / "run-0")
    return "run-0: a FIFO, not a directory"


@pytest.mark.parametrize("case", ["incidents-fifo", "incidents-link", "cordon-fifo", "cordon-device", "cordon-gpus",
                                  "cordon-nodes", "cordon-list", "cordon-deep", "log-fifo", "logs-link",
                                  "beats-fifo"])
def test_what_is_planted_in_the_state_directory_is_one_line_before_the_group_starts(cli, tmp_path, case):
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "user.txt").write_text("mine")
    match = _plant(state, case, tmp_path)
    started = tmp_path / "started"
    _one_line(cli, ["supervise", "--state-dir", state, "--node", NODE, "--", *_python(f"open({str(started)!r}, 'w')")],
              match)
    assert not started.exists() and (tmp_path / "user.txt").read_text() == "mine"


def test_planted_heartbeats_are_ignored_and_nothing_but_zaya_files_is_removed(tmp_path):
    """A state directory used before, holding a user's file and heartbeats that are not: the supervisor removes only
    its own heartbeat files, ignores the rest with a note, and returns when its worker does (one that plants a
    FIFO where a heartbeat goes, which the supervisor reads at every poll)."""
    state = tmp_path / "state"
    beats = state / "heartbeats" / NODE / "run-0"
    beats.mkdir(parents=True)
    (beats / "notes.txt").write_text("a user's notes")
    (beats / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 1, "section": "step", "step": 3, "time": 1.0}))
    (tmp_path / "target.json").write_text("{}")
    (beats / "rank-1.json").symlink_to(tmp_path / "target.json")
    (beats / "rank-2.json").symlink_to("/dev/zero")
    worker = _python(f"import os, json; os.mkfifo({str(beats / 'rank-3.json')!r}); "
                     f"open({str(beats / 'rank-4.json')!r}, 'w').write(json.dumps("
                     "{'rank': 4, 'pid': 10**30, 'section': 'step', 'step': 'x', 'time': 1e300}))")
    said: list[str] = []
    code = Supervisor(worker, _policy(tmp_path), state, environ=os.environ, node=NODE, say=said.append).run()
    assert code == EXIT_OK, said
    assert not (beats / "rank-0.json").exists()  # zaya's name, a regular file: an old beat, removed
    assert (beats / "notes.txt").read_text() == "a user's notes" and (tmp_path / "target.json").read_text() == "{}"
    assert (beats / "rank-1.json").is_symlink() and (beats / "rank-3.json").exists()  # not followed, not removed
    notes = "\n".join(line for line in said if line.startswith("warning: heartbeat file ignored"))
    assert "rank-3.json: a FIFO" in notes and "rank-4.json: not a heartbeat" in notes and "rank-2.json" in notes


def test_a_heartbeat_writer_writes_through_no_planted_file(tmp_path):
    (tmp_path / "user.txt").write_text("mine")
    (tmp_path / ".rank-0.json.tmp").symlink_to(tmp_path / "user.txt")  # the writer's old temporary name
    Heartbeat(tmp_path, 0).beat("step", 1)
    assert (tmp_path / "user.txt").read_text() == "mine"
    assert json.loads((tmp_path / "rank-0.json").read_text())["step"] == 1


# ---- the group's processes and output ---------------------------------------------------------------------


def test_a_failed_workers_background_children_are_ended_and_its_long_line_is_cut(tmp_path):
    """A worker that starts a background child and one that leaves its session (setsid), prints a 1 MB line and
    fails: when the supervisor returns, both children are gone, and the log holds the line cut with a marker."""
    script = tmp_path / "worker.sh"
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path / 'bg.pid'}\n"
                      f"setsid sleep 61 &\necho $! > {tmp_path / 'sid.pid'}\n"
                      "head -c 1000000 /dev/zero | tr '\\0' x; echo\necho worker done\nexit 3\n")
    script.chmod(0o755)
    said: list[str] = []
    pids = []
    try:
        code = Supervisor([str(script)], _policy(tmp_path), tmp_path / "state", environ=os.environ, node=NODE,
                          say=said.append).run()
        pids = [int((tmp_path / name).read_text()) for name in ("bg.pid", "sid.pid")]
        assert code == EXIT_EXHAUSTED, said
        deadline = time.time() + 5
        while any(process_state(pid) not in (None, "Z") for pid in pids) and time.time() < deadline:
            time.sleep(0.02)
        assert [process_state(pid) in (None, "Z") for pid in pids] == [True, True]
    finally:
        for pid in pids:
            if process_state(pid) not in (None, "Z"):
                os.kill(pid, 9)
    lines = (tmp_path / "state" / "logs" / NODE / "run-0.log").read_bytes().splitlines()
    assert lines[0] == b"x" * LINE_CAP + f" [... {1_000_000 - LINE_CAP:,} bytes cut]".encode()
    assert lines[1] == b"worker done"


def test_the_output_reader_holds_no_more_than_a_line_of_a_huge_line(tmp_path):
    block = b"x" * (1 << 16)
    chunks = iter([block] * 800 + [b"\nRuntimeError: after it\n", b""])  # a 50 MB line, then a short one
    log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o644)
    tracemalloc.start()
    try:
        output = GroupOutput(lambda _: next(chunks), log, echo=None)
        assert output.join(30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak
    tail = output.lines()
    assert len(tail[0]) == TAIL_LINE and tail[1] == "RuntimeError: after it"
    assert (tmp_path / "log").stat().st_size < LINE_CAP + 100


# ---- torchrun's sizes and the policy's numbers ------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    (["--nproc-per-node", "1000000000"], "--nproc-per-node '1000000000': must be an integer in 1..1,024"),
    (["--nproc-per-node=1e9"], "--nproc-per-node '1e9'"),
    (["--nproc_per_node", "0"], "--nproc-per-node '0'"),
    (["--nproc-per-node", "-1"], "--nproc-per-node '-1'"),
    (["--nnodes", "0"], "--nnodes '0': must be N or MIN:MAX, each an integer in 1..65,536"),
    (["--nnodes", "3:1"], "--nnodes '3:1': the minimum is above the maximum"),
    (["--nnodes=1:"], "--nnodes '1:'"),
    (["--nnodes", "2", "--nnodes", "9" * 400], "--nnodes '999"),  # the last one counts, as for torchrun
], ids=["1e9", "1e9-text", "zero", "negative", "nodes-0", "nodes-3:1", "nodes-open", "nodes-last"])
def test_torchrun_sizes_are_checked_before_anything_starts(cli, tmp_path, options, match):
    command = [sys.executable, "-m", "torch.distributed.run", *options, "train.py"]
    _one_line(cli, ["supervise", "--state-dir", tmp_path / "state", "--", *command], match)
    assert not (tmp_path / "state").exists()


def test_torchrun_sizes_that_are_fine():
    def command(*options):
        return WorkerCommand([sys.executable, "-m", "torch.distributed.run", *options, "train.py"])

    assert command("--nproc-per-node", "gpu").nproc_per_node() is None
    assert command("--nproc-per-node=1024", "--nnodes=2:4").nproc_per_node() == 1024
    assert command("--nnodes", "1", "--nnodes", "2:3").nnodes() == (2, 3)
    assert command("--nnodes", "1", "--nnodes", "2:3").resized(None, 2)[3:7] == ["--nnodes", "1", "--nnodes", "2:2"]


@pytest.mark.parametrize(("text", "match"), [
    ("[supervisor]\npoll_s = 0\n", "'supervisor.poll_s' must be a finite number in [0.01, 3600], got 0"),
    ("[supervisor]\npoll_s = inf\n", "'supervisor.poll_s' must be a finite number in [0.01, 3600], got inf"),
    ("[supervisor]\nkill_grace_s = 1e15\n", "'supervisor.kill_grace_s' must be a finite number in [0, 10000000]"),
    ("[supervisor]\nstop_grace_s = 1e300\n", "'supervisor.stop_grace_s' must be a finite number in [0, 10000000]"),
    ("[supervisor]\nmax_restarts = 99999999999999999999\n", "'supervisor.max_restarts' must be an integer in 0..1,000"),
    ("[supervisor]\nkernel_log = [1]\n", "'supervisor.kernel_log.0' must be a string"),
    ("[heartbeat]\ninit_timeout_s = 1e300\n", "'heartbeat.init_timeout_s' must be a finite number in [0, 10000000]"),
    ("[heartbeat]\nfactor = 0.5\n", "'heartbeat.factor' must be a finite number in [1, 1000]"),
    ("[training]\nspike_window = 0\n", "'training.spike_window' must be an integer in 1..100,000"),
    ("[training]\nspike_ratio = 'high'\n", "'training.spike_ratio' must be a finite number in [1, 1000000]"),
    ("[probes]\ncommand_timeout_s = 1e300\n", "'probes.command_timeout_s' must be a number of seconds in [0.01, "),
    ("[[rule]]\nsignal = 'oom'\naction = 'stop'\nmin_count = 1000000000000\n", "'rule[0].min_count' must be a posi"),
    ("a = " + "[" * 100 + "]" * 100 + "\n", "nested more than 64 deep"),
], ids=["poll-0", "poll-inf", "grace-1e15", "stop-1e300", "restarts-huge", "kernel-log", "init-1e300", "factor",
        "window", "ratio-type", "probe-timeout", "min-count", "deep"])
def test_every_policy_number_is_finite_and_in_range(tmp_path, text, match):
    (tmp_path / "policy.toml").write_text(text)
    with pytest.raises(ZayaError) as error:
        Policy.load(tmp_path / "policy.toml")
    assert match in str(error.value) and "policy.toml" in str(error.value) and "\n" not in str(error.value)


# ---- diagnose: timestamps, long lines, stdin --------------------------------------------------------------


def test_far_timestamps_leave_a_line_untimed():
    lines = ["0001-01-01T00:00:00+05:00 " + XID, "9999-12-31T23:59:59-05:00 RuntimeError: CUDA error: out of memory",
             "[99999-01-01 00:00:00] x", "1e300 NCCL watchdog timeout"]
    assert classify_lines(lines).root == "gpu_xid"  # untimed: input order decides


def test_a_huge_matching_line_is_cut_in_what_diagnose_prints(cli, tmp_path):
    (tmp_path / "w.log").write_text("[rank0]: RuntimeError: CUDA error: an illegal memory access" + "x" * 1_000_000
                                    + "\n" + "[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout"
                                    + "y" * 100_000 + "\n")
    code, out, _ = cli("diagnose", tmp_path / "w.log")
    assert code == 0 and all(len(line) < 1000 for line in out.splitlines()), [len(x) for x in out.splitlines()]
    assert "more characters cut]" in out
    code, out, _ = cli("diagnose", "--json", tmp_path / "w.log")
    payload = json.loads(out)
    assert len(payload["line"]) < 600 and len(payload["cascade"][0]) < 600


# ---- incidents, probe outputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "match"), [
    ('{"time": "x", "evidence": 5}\n', "incidents.jsonl:1: field 'evidence' must be a list"),
    ('{"time": "x"}\n[1, 2]\n"text"\n', "incidents.jsonl:2: expected a JSON object"),
    ('{"evidence": ["a"]}\n', "incidents.jsonl:1: missing field 'time'"),
    ('{"time": "t", "step": "x", "signal": "nan"}\n', "field 'step' must be an integer"),
    ('{"time": 5}\n', "field 'time' must be a string"),
    ('{"time": "t", "a": ' + "[" * 50 + "]" * 50 + "}\n{}\n", "incidents.jsonl:1: not a JSON line"),
], ids=["evidence", "list", "no-time", "step", "time", "deep"])
def test_incident_records_of_the_wrong_type_are_one_line(tmp_path, text, match):
    (tmp_path / "incidents.jsonl").write_text(text)
    with pytest.raises(ZayaError) as error:
        read_incidents(tmp_path / "incidents.jsonl")
    assert match in str(error.value) and "\n" not in str(error.value)


def test_incidents_are_cut_and_never_written_through_a_link(tmp_path):
    log = IncidentLog(tmp_path / "incidents.jsonl")
    record = log.append({"signal": "python", "evidence": ["x" * 1_000_000], "detail": "y" * 10_000})
    assert len(record["evidence"][0]) < 600 and len(record["detail"]) < 600
    (tmp_path / "user.txt").write_text("mine")
    (tmp_path / "other.jsonl").symlink_to(tmp_path / "user.txt")
    with pytest.raises(ZayaError, match=r"other\.jsonl: a symbolic link, not a regular file"):
        IncidentLog(tmp_path / "other.jsonl").append({"signal": "nan"})
    assert (tmp_path / "user.txt").read_text() == "mine"
    _fifo(tmp_path / "fifo.jsonl")
    with pytest.raises(ZayaError, match=r"fifo\.jsonl: a FIFO, not a regular file"):
        IncidentLog(tmp_path / "fifo.jsonl").append({"signal": "nan"})
    with pytest.raises(ZayaError, match=r"fifo\.jsonl: a FIFO, not a regular file"):
        read_incidents(tmp_path / "fifo.jsonl")


def test_probe_outputs_that_are_hostile_are_noted_not_raised(tmp_path):
    smi = tmp_path / "amd-smi"
    answers = ['[{"gpu": 0, "ecc": ' + "[" * 5000 + "]" * 5000 + "}]",
               '[{"gpu": 99999999999999999999, "ecc": {}}, {"gpu": 1, "ecc": {"total_uncorrectable_count": "'
               + "9" * 5000 + '"}}]']
    errors = []
    for answer in answers:
        (tmp_path / "answer").write_text(answer)
        smi.write_text(f"#!/bin/sh\ncat {tmp_path / 'answer'}\n")
        smi.chmod(0o755)
        probe = GpuProbe(ProbeConfig(root=str(tmp_path), amd_smi=[str(smi)]), "amd-smi")
        assert probe.poll() == []
        errors.append(probe.last_error)
    assert "nested too deep" in errors[0] and errors[1] is None
    net = tmp_path / "sys" / "class" / "net"
    (net / "eth0").mkdir(parents=True)
    _fifo(net / "eth0" / "operstate")
    (net / "eth1").mkdir()
    (net / "eth1" / "operstate").write_text("up\n")
    (net / "eth1" / "carrier_changes").write_text("9" * 5000)
    probe = NicProbe(ProbeConfig(root=str(tmp_path), nics=["eth0", "eth1"]))
    assert probe.poll() == [] and "not a regular file" in probe.last_error and "expected a counter" in \
        probe.last_error
    with pytest.raises(ReadError, match="more than 1 MiB of output"):
        run_command(["yes"], 10.0, max_bytes=1 << 20)
