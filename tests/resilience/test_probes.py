"""The hardware probes against a fake machine: a sysfs tree under tmp_path and smi commands that print a file."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from zaya.errors import ZayaError
from zaya.resilience.gpu_probe import AMD_SMI_ARGS, NVIDIA_SMI_ARGS, GpuProbe, gpu_backend
from zaya.resilience.probe_config import ProbeConfig
from zaya.resilience.probes import NicProbe, StorageProbe, build_probes

CAT = shutil.which("cat")


class FakeCommand:
    """An executable that records its arguments and prints what `answer` set, so a test changes it between polls."""

    def __init__(self, directory: Path, name: str):
        self.dir = directory / f"{name}.d"
        self.dir.mkdir(parents=True)
        self.path = directory / name
        self.path.write_text(
            "#!/bin/sh\n"
            f'echo "$@" > "{self.dir}/argv"\n'
            f'{CAT} "{self.dir}/stdout"\n'
            f'{CAT} "{self.dir}/stderr" >&2\n'
            f'exit "$({CAT} "{self.dir}/rc")"\n'
        )
        self.path.chmod(0o755)
        self.answer("")

    def answer(self, stdout: str, stderr: str = "", rc: int = 0) -> None:
        (self.dir / "stdout").write_text(stdout)
        (self.dir / "stderr").write_text(stderr)
        (self.dir / "rc").write_text(str(rc))

    def argv(self) -> list[str]:
        return (self.dir / "argv").read_text().split()


class FakeSys:
    """A sysfs tree under `root`: network interfaces, InfiniBand ports and amdgpu cards with RAS counters."""

    def __init__(self, root: Path):
        self.root = root

    def write(self, path: str, text: str) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")

    def net(self, name: str, operstate: str = "up", carrier_changes: int = 0, device: bool = True) -> None:
        self.write(f"sys/class/net/{name}/operstate", operstate)
        self.write(f"sys/class/net/{name}/carrier_changes", str(carrier_changes))
        if device:  # a physical interface's link to its PCI device; virtual ones have none
            (self.root / f"sys/class/net/{name}/device").mkdir()

    def ib(self, device: str, port: int, state: str = "4: ACTIVE", link_downed: int = 0) -> None:
        self.write(f"sys/class/infiniband/{device}/ports/{port}/state", state)
        self.write(f"sys/class/infiniband/{device}/ports/{port}/counters/link_downed", str(link_downed))

    def ras(self, card: str, block: str, ue: int, ce: int = 0) -> None:
        self.write(f"sys/class/drm/{card}/device/ras/{block}_err_count", f"ue: {ue}\nce: {ce}")


@pytest.fixture
def fake(tmp_path) -> FakeSys:
    return FakeSys(tmp_path / "root")


def nvidia_rows(*rows: tuple[int, str, str, str]) -> str:
    """nvidia-smi's `--format=csv,noheader,nounits` answer: `index, pci.bus_id, volatile, aggregate`."""
    return "".join(f"{index}, {bus}, {volatile}, {aggregate}\n" for index, bus, volatile, aggregate in rows)


BUS = ["00000000:18:00.0", "00000000:3B:00.0", "00000000:86:00.0"]


def nvidia_probe(tmp_path, fake) -> tuple[GpuProbe, FakeCommand]:
    command = FakeCommand(tmp_path / "bin", "nvidia-smi")
    config = ProbeConfig(root=str(fake.root), gpu="nvidia-smi", nvidia_smi=[str(command.path)])
    return GpuProbe(config, "nvidia-smi"), command


# ---- GPUs ------------------------------------------------------------------------------------------------


def test_nvidia_ecc_increase_is_reported_once_and_the_baseline_is_history(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows((0, BUS[0], "0", "5"), (1, BUS[1], "0", "0")))
    assert probe.poll() == []  # gpu 0's 5 aggregate errors happened before the probe started
    assert smi.argv() == NVIDIA_SMI_ARGS
    smi.answer(nvidia_rows((0, BUS[0], "0", "5"), (1, BUS[1], "2", "2")))
    [finding] = probe.poll()
    assert (finding.signal, finding.subject, finding.count, finding.gpu) == ("gpu_ecc", "gpu:1", 2, 1)
    assert finding.detail == "uncorrectable ECC errors 0 -> 2 (volatile), 0 -> 2 (aggregate)"
    assert finding.line == f"1, {BUS[1]}, 2, 2"
    assert probe.poll() == []
    assert probe.last_error is None
    # volatile counts restart at a driver reload: the drop is a new baseline, the next error is news again
    smi.answer(nvidia_rows((0, BUS[0], "0", "5"), (1, BUS[1], "0", "2")))
    assert probe.poll() == []
    smi.answer(nvidia_rows((0, BUS[0], "0", "5"), (1, BUS[1], "1", "3")))
    [finding] = probe.poll()
    assert (finding.subject, finding.count) == ("gpu:1", 1)


def test_nvidia_unknown_values_are_not_zero(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows((0, BUS[0], "[N/A]", "[N/A]"), (1, BUS[1], "[Not Supported]", "[Not Supported]")))
    assert probe.poll() == []
    # the first known value is a baseline, not an increase from zero
    smi.answer(nvidia_rows((0, BUS[0], "4", "[N/A]"), (1, BUS[1], "[Not Supported]", "[Not Supported]")))
    assert probe.poll() == []
    smi.answer(nvidia_rows((0, BUS[0], "[N/A]", "[N/A]"), (1, BUS[1], "[Not Supported]", "[Not Supported]")))
    assert probe.poll() == []
    smi.answer(nvidia_rows((0, BUS[0], "5", "[N/A]"), (1, BUS[1], "[Not Supported]", "[Not Supported]")))
    [finding] = probe.poll()
    assert (finding.subject, finding.count) == ("gpu:0", 1)
    assert finding.detail == "uncorrectable ECC errors 4 -> 5 (volatile)"


def test_nvidia_gpu_missing_from_the_answer_is_lost(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows(*((i, BUS[i], "0", "0") for i in range(3))))
    assert probe.poll() == []
    smi.answer(nvidia_rows((0, BUS[0], "0", "0"), (2, BUS[2], "0", "0")))
    [finding] = probe.poll()
    assert (finding.signal, finding.subject) == ("gpu_lost", "gpu:1")
    assert BUS[1] in finding.line
    assert probe.poll() == []  # reported once, not every second
    # back after a reset, with counters that are history again
    smi.answer(nvidia_rows((0, BUS[0], "0", "0"), (1, BUS[1], "7", "7"), (2, BUS[2], "0", "0")))
    assert probe.poll() == []


def test_nvidia_lost_gpu_named_in_an_error_keeps_the_others(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows(*((i, BUS[i], "0", "0") for i in range(3))))
    assert probe.poll() == []
    # nvidia-smi lists what it can query and exits non-zero, naming the GPU it could not reach
    message = "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error"
    smi.answer(nvidia_rows((0, BUS[0], "0", "0"), (2, BUS[2], "1", "1")), stderr=message + "\n", rc=15)
    findings = probe.poll()
    assert [(f.signal, f.subject) for f in findings] == [("gpu_ecc", "gpu:2"), ("gpu_lost", "gpu:1")]
    assert findings[1].line == message
    assert "status 15" in probe.last_error


def test_nvidia_no_devices_found_loses_every_gpu(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows((0, BUS[0], "0", "0"), (1, BUS[1], "0", "0")))
    probe.poll()
    smi.answer("No devices were found\n", rc=6)
    assert sorted(f.subject for f in probe.poll() if f.signal == "gpu_lost") == ["gpu:0", "gpu:1"]


def test_a_failing_command_reports_nothing_and_sets_last_error(tmp_path, fake):
    probe, smi = nvidia_probe(tmp_path, fake)
    smi.answer(nvidia_rows((0, BUS[0], "0", "0")))
    assert probe.poll() == []
    smi.answer(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
        "NVIDIA driver is installed and running.\n",
        rc=9,
    )
    assert probe.poll() == []  # a failure is not a lost GPU
    assert "status 9" in probe.last_error and "couldn't communicate" in probe.last_error
    smi.answer(nvidia_rows((0, BUS[0], "0", "0")))
    assert probe.poll() == []
    assert probe.last_error is None
    smi.path.unlink()
    assert probe.poll() == []
    assert "nvidia-smi" in probe.last_error


def test_a_command_past_its_timeout_is_killed(tmp_path, fake):
    script = tmp_path / "slow-smi"
    script.write_text("#!/bin/sh\nsleep 30\n")  # the sleep is a child the timeout must kill too
    script.chmod(0o755)
    config = ProbeConfig(root=str(fake.root), nvidia_smi=[str(script)], command_timeout_s=0.3)
    probe = GpuProbe(config, "nvidia-smi")
    start = time.monotonic()
    assert probe.poll() == []
    assert time.monotonic() - start < 10
    assert "no answer within 0.3 s" in probe.last_error


def amd_answer(counts: dict[int, int | str], wrapped: bool = False) -> str:
    """`amd-smi metric --ecc --json`: a list per GPU (ROCm 6), wrapped in {"gpu_data": ...} by newer releases."""
    gpus = []
    for gpu, count in counts.items():
        ecc = {"total_correctable_count": 0, "total_uncorrectable_count": count, "total_deferred_count": 0,
               "cache_correctable_count": 0, "cache_uncorrectable_count": 0}  # fmt: skip
        gpus.append({"gpu": gpu, "ecc": ecc})
    return json.dumps({"gpu_data": gpus} if wrapped else gpus, indent=4) + "\n"


@pytest.mark.parametrize("wrapped", [False, True])
def test_amd_smi_ecc_and_lost(tmp_path, fake, wrapped):
    smi = FakeCommand(tmp_path / "bin", "amd-smi")
    probe = GpuProbe(ProbeConfig(root=str(fake.root), amd_smi=[str(smi.path)]), "amd-smi")
    smi.answer(amd_answer({0: 0, 1: 3, 2: "N/A"}, wrapped))
    assert probe.poll() == []
    assert smi.argv() == AMD_SMI_ARGS
    smi.answer(amd_answer({0: 0, 1: 5, 2: "N/A"}, wrapped))
    [finding] = probe.poll()
    assert (finding.signal, finding.subject, finding.count) == ("gpu_ecc", "gpu:1", 2)
    assert finding.detail == "uncorrectable ECC errors 3 -> 5 (total)"
    smi.answer(amd_answer({0: 0, 1: 5}, wrapped))
    [finding] = probe.poll()
    assert (finding.signal, finding.subject) == ("gpu_lost", "gpu:2")
    smi.answer("not json", rc=0)
    assert probe.poll() == []
    assert "not JSON" in probe.last_error


def test_sysfs_ras_counters(fake):
    fake.write("sys/class/drm/card0/device/vendor", "0x8086")  # an integrated GPU without RAS: not counted
    fake.write("sys/class/drm/card1-DP-1/status", "disconnected")  # a connector, not a card
    for card in ("card1", "card2", "card10"):
        fake.ras(card, "umc", 0, 3)
        fake.ras(card, "gfx", 0)
    fake.write("sys/class/drm/card10/device/ras/gpu_vram_bad_pages", "0x00000001 : 0x00001000 : R")
    probe = GpuProbe(ProbeConfig(root=str(fake.root)), "sysfs")
    assert probe.poll() == []
    # card10 is GPU 2: the cards with RAS counters in numeric order
    fake.ras("card10", "umc", 2, 3)
    fake.ras("card10", "gfx", 1)
    [finding] = probe.poll()
    assert (finding.signal, finding.subject, finding.count) == ("gpu_ecc", "gpu:2", 3)
    assert finding.detail == "uncorrectable ECC errors 0 -> 1 (gfx), 0 -> 2 (umc)"  # disjoint blocks: they add up
    assert "/sys/class/drm/card10/device/ras/umc_err_count: ue: 2 ce: 3" in finding.line
    assert str(fake.root) not in finding.line
    fake.write(
        "sys/class/drm/card10/device/ras/gpu_vram_bad_pages",
        "0x00000001 : 0x00001000 : R\n0x00000002 : 0x00001000 : R\n0x00000003 : 0x00001000 : P",
    )
    [finding] = probe.poll()
    assert (finding.subject, finding.count, finding.detail) == ("gpu:2", 1, "retired VRAM pages 1 -> 2")
    shutil.rmtree(fake.root / "sys/class/drm/card2")
    [finding] = probe.poll()
    assert (finding.signal, finding.subject) == ("gpu_lost", "gpu:1")
    assert probe.poll() == []


# ---- network ---------------------------------------------------------------------------------------------


def test_operstate_down_is_reported_once_per_change(fake):
    fake.net("lo", "unknown", device=False)
    fake.net("docker0", "down", device=False)  # virtual: not watched unless named
    fake.net("eth0", "up")
    fake.net("eth1", "down")
    probe = NicProbe(ProbeConfig(root=str(fake.root)))
    [finding] = probe.poll()  # a link already down at the start is news
    assert (finding.signal, finding.subject, finding.line) == ("nic", "nic:eth1", "/sys/class/net/eth1/operstate: down")
    assert probe.poll() == []
    fake.write("sys/class/net/eth0/operstate", "down")
    [finding] = probe.poll()
    assert (finding.subject, finding.detail) == ("nic:eth0", "eth0 is down after being up")
    assert probe.poll() == []
    fake.write("sys/class/net/eth0/operstate", "up")
    assert probe.poll() == []
    fake.write("sys/class/net/eth0/operstate", "lowerlayerdown")
    [finding] = probe.poll()
    assert finding.subject == "nic:eth0"
    assert probe.last_error is None


def test_a_vanished_interface_is_reported(fake):
    fake.net("eth0")
    probe = NicProbe(ProbeConfig(root=str(fake.root)))
    assert probe.poll() == []
    shutil.rmtree(fake.root / "sys/class/net/eth0")
    [finding] = probe.poll()
    assert (finding.subject, finding.line) == ("nic:eth0", "/sys/class/net/eth0: no such interface")
    assert probe.poll() == []


def test_carrier_changes_count_is_cumulative(fake):
    fake.net("eth0", carrier_changes=3)
    probe = NicProbe(ProbeConfig(root=str(fake.root)))
    assert probe.poll() == []  # three changes before the start (the boot's link-up among them) are history
    fake.write("sys/class/net/eth0/carrier_changes", "5")
    [finding] = probe.poll()
    assert (finding.signal, finding.subject, finding.count) == ("nic_flap", "nic:eth0", 2)
    assert finding.line == "/sys/class/net/eth0/carrier_changes: 5"
    assert probe.poll() == []
    fake.write("sys/class/net/eth0/carrier_changes", "8")
    [finding] = probe.poll()
    assert finding.count == 5


def test_infiniband_port_leaving_active_and_link_downed(fake):
    fake.ib("mlx5_0", 1)
    fake.ib("mlx5_1", 1, link_downed=4)
    probe = NicProbe(ProbeConfig(root=str(fake.root)))
    assert probe.poll() == []
    fake.ib("mlx5_0", 1, state="1: DOWN", link_downed=1)
    [finding] = probe.poll()
    assert (finding.signal, finding.subject, finding.count) == ("nic", "ib:mlx5_0/1", 1)
    assert "/sys/class/infiniband/mlx5_0/ports/1/state: 1: DOWN" in finding.line
    assert "ACTIVE" in finding.detail
    assert probe.poll() == []
    fake.ib("mlx5_0", 1, state="2: INIT", link_downed=1)  # still not ACTIVE: the same outage
    assert probe.poll() == []
    # a flap between two polls: the port is ACTIVE both times, the counter tells
    fake.ib("mlx5_1", 1, link_downed=7)
    [finding] = probe.poll()
    assert (finding.subject, finding.count) == ("ib:mlx5_1/1", 3)
    assert finding.line == "/sys/class/infiniband/mlx5_1/ports/1/counters/link_downed: 7"


def test_named_interfaces_only_and_a_missing_one_is_reported(fake):
    fake.net("eth0", "down")
    fake.net("bond0", "up", device=False)
    fake.ib("mlx5_0", 1, state="1: DOWN")
    fake.ib("mlx5_0", 2, state="1: DOWN")
    fake.ib("mlx5_1", 1, state="1: DOWN")
    probe = NicProbe(ProbeConfig(root=str(fake.root), nics=["bond0", "mlx5_0/2", "mlx5_1", "ens9"]))
    assert sorted(f.subject for f in probe.poll()) == ["ib:mlx5_0/2", "ib:mlx5_1/1", "nic:ens9"]
    fake.write("sys/class/net/bond0/operstate", "down")
    assert [f.subject for f in probe.poll()] == ["nic:bond0"]


# ---- storage ---------------------------------------------------------------------------------------------


def test_disk_low_when_it_becomes_low(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = ProbeConfig(storage=[str(ckpt), str(tmp_path / "not-made-yet")], min_free_bytes=2**62)
    probe = StorageProbe(config)
    findings = probe.poll()
    assert [(f.signal, f.subject) for f in findings] == [
        ("disk_low", f"path:{ckpt}"), ("disk_low", f"path:{tmp_path / 'not-made-yet'}"),
    ]  # fmt: skip
    assert findings[0].line.startswith("free ") and findings[0].line.endswith(f" GiB < 4294967296.0 GiB on {ckpt}")
    assert "4294967296.0 GiB" in findings[0].detail
    assert f"measured on {tmp_path}" in findings[1].detail
    assert probe.poll() == []
    config.min_free_bytes = 0
    assert probe.poll() == []
    config.min_free_bytes = 2**62
    assert len(probe.poll()) == 2
    assert probe.last_error is None


# ---- configuration ---------------------------------------------------------------------------------------


def test_from_dict():
    config = ProbeConfig.from_dict(
        {"gpu": "sysfs", "nics": ["ib0"], "storage": ["/ckpt"], "min_free_bytes": 2**30, "command_timeout_s": 3},
        "policy.toml",
    )
    assert (config.gpu, config.nics, config.storage, config.min_free_bytes) == ("sysfs", ["ib0"], ["/ckpt"], 2**30)
    assert config.command_timeout_s == 3.0 and config.nvidia_smi == ["nvidia-smi"]
    assert ProbeConfig.from_dict({}, "policy.toml") == ProbeConfig()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus": "auto"}, "policy.toml: unknown key 'probes.gpus'"),
        ({"rocm_smi": ["rocm-smi"]}, "policy.toml: unknown key 'probes.rocm_smi'"),
        ({"gpu": "cuda"}, "policy.toml: 'probes.gpu' must be one of auto, nvidia-smi, amd-smi, rocm-smi, sysfs, none"),
        ({"nics": "eth0"}, "policy.toml: 'probes.nics' must be a list of strings (at most 4,096), got 'eth0'"),
        ({"storage": [1]}, "policy.toml: 'probes.storage' must be a list of strings"),
        ({"nvidia_smi": []}, "policy.toml: 'probes.nvidia_smi' must be a non-empty list of strings"),
        ({"min_free_bytes": True}, "policy.toml: 'probes.min_free_bytes' must be a non-negative integer"),
        ({"min_free_bytes": -1}, "policy.toml: 'probes.min_free_bytes' must be a non-negative integer"),
        ({"command_timeout_s": 0}, "policy.toml: 'probes.command_timeout_s' must be a number of seconds in [0.01, "),
        ({"root": 3}, "policy.toml: 'probes.root' must be a non-empty string"),
    ],
)
def test_from_dict_refuses(data, message):
    with pytest.raises(ZayaError, match="^" + re.escape(message)):
        ProbeConfig.from_dict(data, "policy.toml")


def test_from_dict_refuses_a_non_table():
    with pytest.raises(ZayaError, match=re.escape("policy.toml: 'probes' must be a table, got list")):
        ProbeConfig.from_dict([], "policy.toml")


def only_on_path(monkeypatch, directory: Path, *names: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        FakeCommand(directory, name)
    monkeypatch.setenv("PATH", str(directory))


def test_auto_picks_the_backend_on_path(tmp_path, fake, monkeypatch):
    config = ProbeConfig(root=str(fake.root))
    only_on_path(monkeypatch, tmp_path / "both", "nvidia-smi", "amd-smi")
    assert gpu_backend(config) == "nvidia-smi"
    only_on_path(monkeypatch, tmp_path / "amd", "amd-smi")
    assert gpu_backend(config) == "amd-smi"
    only_on_path(monkeypatch, tmp_path / "empty")
    assert gpu_backend(config) == "none"
    assert [type(probe) for probe in build_probes(config)] == [NicProbe]
    fake.ras("card0", "umc", 0)
    assert gpu_backend(config) == "sysfs"
    probes = build_probes(ProbeConfig(root=str(fake.root), storage=[str(tmp_path)]))
    assert [type(probe) for probe in probes] == [GpuProbe, NicProbe, StorageProbe]
    assert probes[0].backend == "sysfs"


def test_auto_runs_what_it_found(tmp_path, fake, monkeypatch):
    only_on_path(monkeypatch, tmp_path / "bin", "nvidia-smi")
    [gpu, _] = build_probes(ProbeConfig(root=str(fake.root)))
    assert gpu.backend == "nvidia-smi"
    gpu.poll()
    assert (tmp_path / "bin/nvidia-smi.d/argv").read_text().split() == NVIDIA_SMI_ARGS


def test_an_explicit_backend_that_cannot_work_is_an_error(tmp_path, fake, monkeypatch):
    only_on_path(monkeypatch, tmp_path / "empty")
    missing = "probes.gpu is 'nvidia-smi' but the command 'nvidia-smi' was not found"
    with pytest.raises(ZayaError, match=re.escape(missing)):
        build_probes(ProbeConfig(root=str(fake.root), gpu="nvidia-smi"))
    missing = "probes.gpu is 'amd-smi' but the command '/opt/amd-smi' was not found"
    with pytest.raises(ZayaError, match=re.escape(missing)):
        build_probes(ProbeConfig(root=str(fake.root), gpu="amd-smi", amd_smi=["/opt/amd-smi"]))
    with pytest.raises(ZayaError, match=re.escape("probes.gpu is 'sysfs' but no card")):
        build_probes(ProbeConfig(root=str(fake.root), gpu="sysfs"))
    fake.ras("card0", "umc", 0)
    # rocm-smi prints no RAS counts as JSON: it reads the same sysfs counters
    assert build_probes(ProbeConfig(root=str(fake.root), gpu="rocm-smi"))[0].backend == "sysfs"
    assert [type(p) for p in build_probes(ProbeConfig(root=str(fake.root), gpu="none"))] == [NicProbe]
    with pytest.raises(ZayaError, match=re.escape("'probes.gpu' must be one of")):
        build_probes(ProbeConfig(root=str(fake.root), gpu="cuda"))


def test_probes_only_read(tmp_path, fake):
    fake.net("eth0", "down", carrier_changes=2)
    fake.ib("mlx5_0", 1, state="1: DOWN")
    fake.ras("card0", "umc", 1)

    def tree() -> dict[str, str]:
        return {str(p): p.read_text() for p in sorted(fake.root.rglob("*")) if p.is_file()}

    before = tree()
    for probe in build_probes(ProbeConfig(root=str(fake.root), gpu="sysfs", storage=[str(tmp_path)])):
        probe.poll()
        probe.poll()
    assert tree() == before
