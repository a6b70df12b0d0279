"""Weights & Biases as a metrics sink, checked on what W&B wrote: the offline run's `.wandb` files (records in
LevelDB log framing), read back here: the config, every step's values, the report's images, the run id kept
across a resume, and the one-line error without the package."""

import dataclasses
import io
import json
import os
import signal
import struct
import sys
from pathlib import Path

import pytest

from ranks import run_command
from runs import write_config
from zaya.cli import main
from zaya.config import RunConfig, load_config
from zaya.errors import ZayaError
from zaya.resilience.faults import InjectedFault
from zaya.run_dir import WANDB_ID_FILE as ID_FILE
from zaya.train import metrics as metrics_module
from zaya.train.config import LoggingSection
from zaya.train.metrics import MetricsLogger, read_metrics
from zaya.train.wandb_sink import check_wandb, open_wandb
from zaya.training import build_trainer, report_plots

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

# ---- reading what W&B wrote ---------------------------------------------------------------------------

BLOCK = 32768  # the LevelDB log format: 32 KiB blocks of chunks, each with a 7-byte header
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path):
    """The protobuf records of a `.wandb` file (its 7-byte W&B header, then LevelDB log chunks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding
            pos += BLOCK - pos % BLOCK
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclasses.dataclass
class Segment:
    """One start's offline run directory, as W&B recorded it."""

    path: Path
    run_id: str
    project: str
    name: str
    config: dict
    history: dict  # step -> {key: value}
    exit_code: int | None


def _segments(run_dir: Path) -> list[Segment]:
    # W&B's service may still be writing a finished run's last records: its teardown waits for them
    import wandb

    wandb.teardown()
    segments = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = directory.glob("*.wandb")
        config, history, exit_code, run = {}, {}, None, None
        for record in _records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config.update({item.key: json.loads(item.value_json) for item in run.config.update})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                step = items.pop("_step")
                assert step not in history, f"{directory.name}: step {step} logged twice"
                history[step] = items
            elif kind == "exit":
                exit_code = record.exit.exit_code
        config.pop("_wandb", None)
        segments.append(Segment(directory, run.run_id, run.project, run.display_name, config, history, exit_code))
    return segments


def _user_keys(values: dict) -> dict:
    return {key: value for key, value in values.items() if not key.startswith("_")}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, quiet, and writing nothing outside the test's directory."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    return home


def _config(**logging) -> RunConfig:
    return dataclasses.replace(RunConfig(), logging=LoggingSection(wandb=True, **logging))


def _open(run_dir: Path, config: RunConfig, start_step: int):
    """The sink `zaya train` opens, in the mode WANDB_MODE says unless the config does."""
    return open_wandb(run_dir, config.logging, config.to_dict(), start_step, os.environ.get("WANDB_MODE", ""))


def _row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 8e-3, "batch_size": 8, "tokens": 256 * step, "phase": "main",
            "tokens_per_s": 1000.0 + step, "mfu": 0.015, "step_time": 0.25, "time": 1000.0 + step,
            "skipped": False, "stop": None, "expert_load": [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]],
            "expert_imbalance": [1.5, 1.25], "router_entropy": [0.9, 1.0], "peak_memory_bytes": [100, 300],
            "comm_bytes": [0, 0], "grad_norm": float("nan")}


# ---- the sink, under MetricsLogger ----------------------------------------------------------------------


def test_rows_config_and_report_images_reach_wandb(tmp_path, offline):
    run_dir = tmp_path / "run"
    config = _config(wandb_project="tests", wandb_mode="offline")
    logger = MetricsLogger(run_dir, start_step=0, total_steps=4, tensorboard=False, progress=False,
                           sink=_open(run_dir, config, 0))
    for step in range(1, 5):
        logger.log({**_row(step, 3.0 - 0.1 * step), **({"eval_loss": 2.9} if step == 4 else {})})
    logger.finish(lambda: report_plots(run_dir))
    logger.close()

    (segment,) = _segments(run_dir)
    assert segment.run_id == (run_dir / ID_FILE).read_text().strip()
    assert (segment.project, segment.name, segment.exit_code) == ("tests", "run", 0)
    assert segment.config == json.loads(json.dumps(config.to_dict()))
    assert sorted(segment.history) == [1, 2, 3, 4]
    first = _user_keys(segment.history[1])
    assert first["loss"] == pytest.approx(2.9) and first["lr"] == 8e-3 and first["phase"] == "main"
    assert first["skipped"] == 0 and "time" not in first and "stop" not in first and "grad_norm" not in first
    assert first["expert_imbalance/layer_1"] == 1.25 and first["router_entropy/layer_0"] == 0.9
    assert first["peak_memory_bytes/max"] == 300 and first["peak_memory_bytes/mean"] == 200
    assert first["expert_load/layer_0/_type"] == "histogram"
    assert segment.history[4]["eval_loss"] == 2.9
    # the report's plots, at the last step
    images = {key.split("/")[1] for key, value in segment.history[4].items()
              if key.startswith("report/") and key.endswith("/_type") and value == "image-file"}
    assert images == {"loss", "schedule", "throughput", "expert_load"}
    assert len(list((segment.path / "files" / "media" / "images").rglob("*.png"))) == 4
    assert (run_dir / "report" / "index.html").is_file()


def test_a_resume_continues_the_run_and_its_newest_segment_holds_the_whole_history(tmp_path, offline):
    run_dir, config = tmp_path / "run", _config()
    first = MetricsLogger(run_dir, start_step=0, total_steps=8, tensorboard=False, progress=False,
                          sink=_open(run_dir, config, 0))
    for step in range(1, 7):  # a crash after step 6; the last checkpoint is step 4
        first.log(_row(step, 10.0 + step))
    first.close()

    second = MetricsLogger(run_dir, start_step=4, total_steps=8, tensorboard=False, progress=False,
                           sink=_open(run_dir, config, 4))
    for step in range(5, 9):
        second.log(_row(step, 20.0 + step))  # the replayed steps 5 and 6 differ from the crashed attempt's
    second.close()

    earlier, newest = _segments(run_dir)
    assert earlier.run_id == newest.run_id == (run_dir / ID_FILE).read_text().strip()
    assert sorted(earlier.history) == [1, 2, 3, 4, 5, 6]
    assert sorted(newest.history) == list(range(1, 9))  # each step once, in order (checked while reading)
    assert [newest.history[s]["loss"] for s in range(1, 9)] == [row["loss"] for row in read_metrics(run_dir)]
    assert [newest.history[s]["loss"] for s in (4, 5, 6)] == [14.0, 25.0, 26.0]


def test_a_run_that_raises_is_marked_failed(tmp_path, offline):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, start_step=0, total_steps=2, tensorboard=False, progress=False,
                           sink=_open(run_dir, _config(), 0))
    with pytest.raises(ZayaError):
        try:
            logger.log(_row(1, 3.0))
            raise ZayaError("step 2: the loss is nan")
        finally:
            logger.close()
    (segment,) = _segments(run_dir)
    assert segment.exit_code == 1 and sorted(segment.history) == [1]


def test_no_sink_without_logging_wandb_or_in_disabled_mode(tmp_path, offline, monkeypatch):
    assert _open(tmp_path, RunConfig(), 0) is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _open(tmp_path, _config(), 0) is None
    assert not (tmp_path / "wandb").exists()


def test_the_configs_mode_wins_over_the_environments(tmp_path, offline):
    assert _open(tmp_path, _config(wandb_mode="disabled"), 0) is None  # WANDB_MODE is offline
    assert not (tmp_path / "wandb").exists()


def test_a_failing_image_upload_does_not_fail_the_finished_run(tmp_path, offline, capsys):
    sink = _open(tmp_path / "run", _config(), 0)

    def refuse(images: dict) -> None:
        raise OSError("the upload was refused")

    sink.log_images = refuse
    logger = MetricsLogger(tmp_path / "run", start_step=0, total_steps=1, tensorboard=False, progress=False,
                           sink=sink)
    try:
        logger.finish(lambda: {"loss": tmp_path / "loss.png"})
    finally:
        logger.close()
    assert "the report plots failed (OSError: the upload was refused); training is unaffected" in \
        capsys.readouterr().out  # tqdm.write: the progress bar's stream


def test_without_the_wandb_package_the_error_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    for call in (lambda: _open(tmp_path, _config(), 0), lambda: check_wandb(_config().logging)):
        with pytest.raises(ZayaError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message and "pip install 'zaya-stack[wandb]'" in message
        assert "logging.wandb = false" in message
    check_wandb(RunConfig().logging)  # not asked for: nothing to check


def test_a_failing_wandb_init_is_one_line(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ZayaError, match=r"W&B could not start run \w+ of project 'zaya' \(online\): .*wandb login"):
        _open(tmp_path, _config(), 0)


# ---- the progress bar of a time budget ----------------------------------------------------------------------


def test_the_progress_bar_counts_seconds_of_a_time_budget(tmp_path, monkeypatch):
    screen = io.StringIO()
    real = metrics_module.tqdm
    monkeypatch.setattr(metrics_module, "tqdm",
                        lambda **kwargs: real(**{**kwargs, "disable": False, "file": screen, "mininterval": 0}))
    logger = MetricsLogger(tmp_path, start_step=40, total_steps=1000, tensorboard=False, progress=True,
                           progress_seconds=600.0, seconds_done=120.0)
    assert (logger._bar.total, logger._bar.n, logger._bar.unit) == (600.0, 120.0, "s")
    logger.progress(41, {"loss": "2.513"}, seconds=123.4)
    assert logger._bar.n == 123.4
    logger.progress(42, {"loss": "2.500"})  # the old call: the step moves on, the seconds stay
    assert logger._bar.n == 123.4
    last = screen.getvalue().split("\r")[-1]
    assert "123/600 s" in last and "step=42, loss=2.500" in last
    logger.close()

    steps = MetricsLogger(tmp_path, start_step=40, total_steps=1000, tensorboard=False, progress=True)
    steps.progress(41, {"loss": "2.513"})
    assert (steps._bar.total, steps._bar.n) == (1000, 41)
    assert "41/1000" in screen.getvalue().split("\r")[-1]
    steps.close()


# ---- the trainer --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("crash", ["raise", pytest.param("sigkill", marks=pytest.mark.slow)])
def test_a_training_run_logs_to_wandb_and_a_resumed_one_continues_it(dataset, tmp_path, offline, monkeypatch,
                                                                      crash):
    config_path = write_config(tmp_path / "run.toml", dataset, train={"max_steps": 6},
                               logging={"wandb": True, "wandb_mode": "offline", "wandb_name": "tiny-test"})
    run_dir = tmp_path / "run"
    fault = {"ZAYA_FAULTS": f"{crash}@step:5"}  # after the checkpoint of step 3
    if crash == "raise":  # the W&B run is finished as failed
        with pytest.raises(InjectedFault):
            build_trainer(load_config(config_path), run_dir, environ=fault).run()
    else:  # a real process killed with its W&B run open, and with it its own W&B service (not this process's)
        monkeypatch.delenv("WANDB_SERVICE", raising=False)
        killed = run_command([sys.executable, "-m", "zaya.cli", "train", config_path, "--run-dir", run_dir], env=fault)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    build_trainer(load_config(config_path), run_dir).run()

    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    segments = _segments(run_dir)
    assert len(segments) == 2 and {s.run_id for s in segments} == {(run_dir / ID_FILE).read_text().strip()}
    newest = segments[-1]
    assert newest.name == "tiny-test" and newest.exit_code == 0
    assert newest.config == json.loads((run_dir / "run_config.json").read_text())
    assert sorted(newest.history) == [1, 2, 3, 4, 5, 6]
    for row in rows:
        logged = newest.history[row["step"]]
        assert logged["loss"] == row["loss"] and logged["tokens"] == row["tokens"]
        assert logged["expert_imbalance/layer_0"] == row["expert_imbalance"][0]
        assert logged.get("eval_loss") == row.get("eval_loss")
    assert newest.history[6]["report/loss/_type"] == "image-file"


def test_train_without_the_wandb_package_stops_in_one_line(dataset, tmp_path, monkeypatch, capsys):
    config_path = write_config(tmp_path / "run.toml", dataset, logging={"wandb": True})
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(["train", str(config_path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'zaya-stack[wandb]'" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists() and not read_metrics(tmp_path / "run")
