"""Two "nodes" of one torchrun job, each under its own `zaya supervise`, and one of them loses its link.

Each node is a network namespace with one veth into a third namespace that holds a bridge, the "switch": a
link set down on node B then leaves node A's own link up, as on a real fabric (with the two namespaces joined
by one veth pair, A's end would go down with B's and A would cordon itself too). The namespaces share the
hostname and the filesystem, so the run directory and the supervisors' state directory are shared as on a
cluster, and every address the job uses is named: the rendezvous endpoint on A (which hosts its store), each
agent's `--local-addr` and gloo's interface (`GLOO_SOCKET_IFNAME`). Left to the shared hostname, which resolves
to an address of neither node's link (often loopback), the two agents never form the job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import zaya
from ranks import free_port
from runs import write_config
from zaya.errors import EXIT_OK, EXIT_STOPPED
from zaya.resilience.incidents import read_incidents
from zaya.resilience.processes import descendants, signal_all
from zaya.train.metrics import read_metrics

STEPS = 12
DEADLINE_S = 240.0  # the whole scenario; it takes about a minute on two CPU cores
POLICY = """
[supervisor]
poll_s = 0.25
kill_grace_s = 3.0
[heartbeat]
factor = 5.0
floor_s = 5.0
first_timeout_s = 120.0
init_timeout_s = 120.0
[probes]
gpu = "none"
nics = ["{nic}"]
"""


@dataclass(frozen=True)
class Node:
    name: str  # the supervisor's --node
    netns: str
    veth: str  # its end of the link, in its namespace
    address: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _link_state(node: Node) -> str:
    fields = _ip("-n", node.netns, "-brief", "link", "show", "dev", node.veth).stdout.split()
    return fields[1] if len(fields) > 1 else "absent"


@pytest.fixture
def nodes():
    """Nodes A (10.231.0.1) and B (10.231.0.2) on one switch; everything made is deleted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip`")
    tag = os.getpid()  # unique per test process, and short: an interface name has at most 15 characters
    switch, bridge = f"zsw{tag}", f"zbr{tag}"
    a = Node("a", f"zna{tag}", f"zva{tag}", "10.231.0.1")
    b = Node("b", f"znb{tag}", f"zvb{tag}", "10.231.0.2")
    made = []
    try:
        for netns in (a.netns, b.netns, switch):
            result = _ip("netns", "add", netns)
            if result.returncode != 0:
                pytest.skip(f"cannot make a network namespace: ip netns add {netns}: {result.stderr.strip()}")
            made.append(netns)
        steps = [("-n", switch, "link", "add", bridge, "type", "bridge"), ("-n", switch, "link", "set", bridge, "up")]
        for node in (a, b):
            port = f"zp{node.name}{tag}"
            steps += [("link", "add", node.veth, "netns", node.netns, "type", "veth", "peer", "name", port,
                       "netns", switch),
                      ("-n", switch, "link", "set", port, "master", bridge), ("-n", switch, "link", "set", port, "up"),
                      ("-n", node.netns, "link", "set", "lo", "up"),
                      ("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth),
                      ("-n", node.netns, "link", "set", node.veth, "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot make the nodes' network: ip {' '.join(step)}: {result.stderr.strip()}")
        deadline = time.monotonic() + 20
        while any(_link_state(node) != "UP" for node in (a, b)):
            if time.monotonic() > deadline:
                pytest.skip(f"the veth links did not come up: {[_link_state(node) for node in (a, b)]}")
            time.sleep(0.1)
        # the NIC probe reads sysfs, which `ip netns exec` mounts afresh for the namespace
        for node in (a, b):
            seen = subprocess.run(["ip", "netns", "exec", node.netns, "cat", f"/sys/class/net/{node.veth}/operstate"],
                                  capture_output=True, text=True, timeout=30, check=False)
            if seen.stdout.strip() != "up":
                pytest.skip(f"namespace {node.netns} does not see its link in sysfs: "
                            f"{(seen.stdout + seen.stderr).strip()}")
        yield a, b
    finally:
        for netns in made:  # a namespace takes its veth ends, and the bridge, with it
            _ip("netns", "del", netns)


def _torchrun(node: Node, host: Node, port: int, config: Path, run: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={host.address}:{port}", f"--rdzv-id=zaya-two-nodes-{port}",
            f"--rdzv-conf=is_host={int(node == host)}", f"--local-addr={node.address}", "--max-restarts=0",
            "--monitor-interval=0.2", "-m", "zaya.cli", "train", str(config), "--run-dir", str(run)]


def _kill_tree(process: subprocess.Popen) -> None:
    if process.poll() is None:
        signal_all([process.pid, *descendants(process.pid)], signal.SIGKILL)
    process.wait()


def _tail(path: Path, chars: int = 6000) -> str:
    return f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}" if path.is_file() else ""


@pytest.mark.slow
def test_a_node_whose_link_goes_down_is_cordoned_and_the_other_node_finishes_the_run(dataset, tmp_path, nodes):
    """One rank per node; once the checkpoint of step 3 is committed, B's link goes down. B's supervisor
    cordons B and stops; A's sees cordon.json change, kills its rank (stuck in a collective with B) and goes
    on alone, `--nnodes` one fewer, from that checkpoint resharded from 2 ranks to 1."""
    a, b = nodes
    config = write_config(tmp_path / "run.toml", dataset,
                          train={"max_steps": STEPS, "eval_every": 0, "global_batch_size": 8, "micro_batch_size": 4},
                          checkpoint={"every": 3, "keep": 10},
                          parallel={"timeout_s": 60.0, "init_timeout_s": 120.0})
    run, state = tmp_path / "run", tmp_path / "state"
    port = free_port()  # nothing listens in the fresh namespaces: any port is free there
    deadline = time.monotonic() + DEADLINE_S
    supervisors: dict[str, subprocess.Popen] = {}
    outputs = {node.name: tmp_path / f"supervisor-{node.name}.out" for node in nodes}

    def report() -> str:
        return "\n".join(_tail(outputs[name]) for name in supervisors)

    try:
        for node in nodes:
            policy = tmp_path / f"policy-{node.name}.toml"
            policy.write_text(POLICY.format(nic=node.veth))
            command = ["ip", "netns", "exec", node.netns, sys.executable, "-m", "zaya.cli", "supervise",
                       "--policy", str(policy), "--state-dir", str(state), "--node", node.name, "--",
                       *_torchrun(node, a, port, config, run)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": node.veth, "ZAYA_FAULTS": "",
                   "PYTHONUNBUFFERED": "1"}  # the supervisor's own lines in order with its workers
            with outputs[node.name].open("w") as out:
                supervisors[node.name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                          start_new_session=True)
        latest = run / "checkpoints" / "latest"  # written once a checkpoint is committed (step 3 comes first)
        while not latest.is_file():
            exited = {name: p.returncode for name, p in supervisors.items() if p.poll() is not None}
            assert not exited, f"supervisors exited before the first checkpoint: {exited}\n{report()}"
            assert time.monotonic() < deadline, f"no checkpoint within {DEADLINE_S:.0f} s\n{report()}"
            time.sleep(0.05)
        # no later checkpoint can be committed once the link is down: its save needs both ranks
        committed = latest.read_text().strip()
        cut = _ip("-n", b.netns, "link", "set", b.veth, "down")
        assert cut.returncode == 0, cut.stderr
        for name, process in supervisors.items():
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"supervisor {name} did not finish within {DEADLINE_S:.0f} s\n"
                                     f"{report()}") from None
    finally:
        for process in supervisors.values():
            _kill_tree(process)

    assert supervisors["b"].returncode == EXIT_STOPPED, report()
    assert supervisors["a"].returncode == EXIT_OK, report()
    incidents = read_incidents(state / "incidents.jsonl")
    decided = {node.name: [(i["signal"], i["subject"], i["action"]) for i in incidents
                           if i["event"] == "incident" and i.get("node") == node.name] for node in nodes}
    assert decided["b"] == [("nic", f"nic:{b.veth}", "cordon_node")], incidents
    assert json.loads((state / "cordon.json").read_text())["nodes"] == ["b"]
    assert decided["a"] == [("node_cordoned", "node:b", "restart")], incidents
    restarted = outputs["a"].read_text().split("run 1: ")[1].splitlines()[0]
    assert "--nnodes=1" in restarted, restarted

    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))
    log = (run / "train.log").read_text()
    before, resumed = log.split("resumed from ", 1)
    assert "= 2 rank(s)" in before, log[-3000:]
    assert resumed.startswith(str(run / "checkpoints" / committed)), resumed.splitlines()[0]
    assert "written by 2 rank(s)" in resumed.splitlines()[0], resumed.splitlines()[0]
    assert "= 1 rank(s)" in resumed, log[-3000:]
    zaya.load_model(run)
