"""The policy file: first match wins, the built-in rules after the file's, every mistake one clear line."""

import pytest

from zaya.errors import ZayaError
from zaya.resilience.findings import Finding
from zaya.resilience.policy import Policy


def _policy(tmp_path, text: str) -> Policy:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return Policy.load(path)


def test_first_matching_rule_wins_and_builtins_follow(tmp_path):
    policy = _policy(tmp_path, """
[[rule]]
signal = ["oom", "python"]
action = "stop"
[[rule]]
signal = "nic_flap"
subject = "nic:ib*"
min_count = 2
action = "cordon_node"
""")
    assert policy.decide(Finding("oom")).action == "stop"
    assert policy.decide(Finding("nic_flap", "nic:ib0", count=2)).action == "cordon_node"
    assert policy.decide(Finding("nic_flap", "nic:ib0", count=1)).action == "log"  # built-in, below 5
    assert policy.decide(Finding("nic_flap", "nic:eth0", count=9)).action == "cordon_node"  # built-in, at 5
    assert policy.decide(Finding("gpu_ecc", "gpu:3")).action == "cordon_gpu"
    assert policy.decide(Finding("hang", "rank:1")).action == "restart"
    assert policy.decide(Finding("storage")).action == "stop"


def test_settings_are_typed(tmp_path):
    policy = _policy(tmp_path, "[supervisor]\npoll_s = 2\nkernel_log = ['dmesg']\n[heartbeat]\nfloor_s = 5\n"
                     "[training]\nspike_ratio = 2.5\n[probes]\ngpu = 'none'\n")
    assert policy.supervisor.poll_s == 2.0 and policy.supervisor.kernel_log == ["dmesg"]
    assert policy.heartbeat.floor_s == 5.0 and policy.training.spike_ratio == 2.5 and policy.probes.gpu == "none"


@pytest.mark.parametrize(("text", "message"), [
    ("[[rule]]\nsignal = 'gremlins'\naction = 'restart'\n", "'rule[0].signal': unknown signal 'gremlins'"),
    ("[[rule]]\nsignal = 'oom'\naction = 'pray'\n", "'rule[0].action': unknown action 'pray'"),
    ("[[rule]]\nsignal = 'gpu_ecc'\naction = 'skip_step'\n", "taken by the trainer"),
    ("[[rule]]\nsignal = 'oom'\n", "needs both 'signal' and 'action'"),
    ("[[rule]]\nsignal = 'oom'\naction = 'stop'\nmin_count = 0\n", "'rule[0].min_count' must be a positive"),
    ("[[rule]]\nsignal = 'oom'\naction = 'stop'\nwhen = 1\n", "unknown key 'rule[0].when'"),
    ("[heartbeat]\nfactor = 'high'\n", "field 'heartbeat.factor' must be a finite number in [1, 1000], got 'high'"),
    ("[heartbeat]\nfloor_s = -1\n", "field 'heartbeat.floor_s' must be a finite number in [0, 10000000], got -1"),
    ("[supervisor]\nmax_no_progress = 0\n", "field 'supervisor.max_no_progress' must be an integer in 1..1,000,000"),
    ("[alerts]\nx = 1\n", "unknown table 'alerts'"),
    ("[probes]\ncolour = 'red'\n", "unknown key 'probes.colour'"),
    ("[[rule]\n", "not valid TOML"),
], ids=["signal", "action", "trainer-action", "missing", "min-count", "rule-key", "type", "negative",
        "no-progress", "table", "probes", "toml"])
def test_mistakes_name_the_file_and_key(tmp_path, text, message):
    with pytest.raises(ZayaError, match=r"policy\.toml") as error:
        _policy(tmp_path, text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_unreadable_policy_file_is_one_line(tmp_path):
    with pytest.raises(ZayaError, match=r"missing\.toml: file not found"):
        Policy.load(tmp_path / "missing.toml")
