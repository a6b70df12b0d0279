"""What a supervisor hands its trainers: written into their environment by the supervisor, read back by the
`zaya` command alone."""

from pathlib import Path

from zaya.resilience.supervision import Supervision


def test_the_settings_travel_through_the_environment_and_back(tmp_path):
    sent = Supervision(heartbeat_dir=tmp_path / "beats", incidents_file=tmp_path / "incidents.jsonl",
                       policy_file=Path("policy.toml"), run_attempt=3)
    environ = sent.environ()
    assert environ["ZAYA_POLICY"] == str(Path("policy.toml").resolve())  # the trainers may run elsewhere
    received = Supervision.from_environ({**environ, "ZAYA_FAULTS": "nan@step:5", "ZAYA_FAULT_LINE": "Xid 79"})
    assert received.heartbeat_dir == sent.heartbeat_dir and received.incidents_file == sent.incidents_file
    assert received.policy_file == Path("policy.toml").resolve() and received.run_attempt == 3
    assert (received.faults, received.fault_line) == ("nan@step:5", "Xid 79")


def test_without_a_supervisor_nothing_is_set():
    assert Supervision.from_environ({}) == Supervision()
    assert Supervision().environ() == {"ZAYA_RUN_ATTEMPT": "0"}
    assert Supervision.from_environ({"ZAYA_RUN_ATTEMPT": "junk"}).run_attempt == 0
