"""The run config and the trainer against careless or hostile input: every number in a range, `--set` values that
cannot smuggle in more, config files that are no files, run directories and devices that cannot be, sequences
longer than the model is meant for, checkpoints whose JSON holds the wrong types, the run's own files planted as
links or FIFOs, and a run that turns NaN stopping without committing NaN."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from runs import write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.device import resolve_device
from zaya.errors import ZayaError
from zaya.resilience.incidents import read_incidents
from zaya.train.checkpointing import check_finite
from zaya.train.history import record_start
from zaya.train.hooks import Hooks
from zaya.train.inputs import check_resumable, check_rng
from zaya.train.log import RunLog
from zaya.train.metrics import read_metrics, truncate_metrics
from zaya.train.wandb_sink import run_id
from zaya.training import build_trainer, check_run_dir

BASE = '[model]\npreset = "micro"\n[data]\npath = "data"\nseq_len = 64\n'
PHASES = BASE + '[[phases]]\nname = "a"\ntokens = 1000\n[[phases]]\nname = "b"\n'


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(BASE, encoding="utf-8")
    return path


def _refused(path, overrides, match: str) -> str:
    with pytest.raises(ZayaError) as error:
        load_config(path, overrides)
    message = str(error.value)
    assert "\n" not in message and match in message, message
    return message


BIG = "9" * 400
OUT_OF_RANGE = [
    # learning rates, init ranges and the optimizer's numbers: NaN losses to the end, before
    ("optim.lr=1e30", "key 'optim.lr' must be a number in (0, 10], got 1e+30"),
    ("optim.adamw_lr=0", "key 'optim.adamw_lr' must be a number in (0, 10]"),
    ("optim.weight_decay=1e9", "key 'optim.weight_decay' must be a number in [0, 10]"),
    ("optim.adamw_betas=[0.9, 1.0]", "key 'optim.adamw_betas.1' must be a number in [0, 1)"),
    ("optim.adamw_eps=1e-300", "key 'optim.adamw_eps' must be a number in [1e-30, 1]"),
    ("optim.ns_coefficients=[1e300, 0, 0]", "key 'optim.ns_coefficients.0' must be a number in [-100, 100]"),
    ("optim.vector_lr_ratio=1e9", "key 'optim.vector_lr_ratio'"),
    ("model.initializer_range=1e30", "field 'initializer_range' must be in (0, 1], got 1e+30"),
    ("model.rms_norm_eps=1e-300", "field 'rms_norm_eps' must be in [1e-12, 1]"),
    ("model.temp_init=1e9", "field 'temp_init' must be in [-100, 100]"),
    ("model.rope_theta=1e-300", "field 'rope_theta' must be in [1, 1e+12]"),
    ("balance.ki=1e9", "key 'balance.ki' must be a number in [0, 100]"),
    ("schedule.min_ratio=2", "key 'schedule.min_ratio' must be a number in [0, 1]"),
    # timeouts and time limits: 1e15 or 1e300 overflowed a timer or a timedelta
    ("parallel.timeout_s=1e15", "key 'parallel.timeout_s' must be a number in (0, 31,622,400]"),
    ("parallel.init_timeout_s=1e300", "key 'parallel.init_timeout_s'"),
    ("checkpoint.timeout_s=1e15", "key 'checkpoint.timeout_s' must be a number in [0, 31,622,400]"),
    ("train.stop_grace_s=1e300", "key 'train.stop_grace_s'"),
    ("train.max_time_s=1e15", "key 'train.max_time_s'"),
    ("train.time_budget_s=1e300", "key 'train.time_budget_s'"),
    # step counts, seeds, counts of anything: a 400-digit integer was a traceback
    (f"train.max_steps={BIG}", "key 'train.max_steps' must be an integer in 1..1,000,000,000,000, got an integer of"),
    (f"train.seed={BIG}", "key 'train.seed' must be an integer in 0..9,223,372,036,854,775,807"),
    ("train.seed=9223372036854775808", "key 'train.seed'"),
    (f"optim.lr={BIG}", "key 'optim.lr' must be a finite number"),  # float() of it overflowed
    (f"schedule.total_steps={BIG}", "key 'schedule.total_steps'"),
    ("checkpoint.keep=10000000000", "key 'checkpoint.keep' must be an integer in 1..1,000,000"),
    ("data.ramp_samples=-1", "key 'data.ramp_samples'"),
    ("data.block_size=0", "key 'data.block_size' must be an integer in 1..16,777,216"),
    ("parallel.dp_shard=-2", "key 'parallel.dp_shard' must be an integer in -1 or 1..1,048,576"),
    ("parallel.ep=100000000", "key 'parallel.ep'"),
    (f"train.eval_every={BIG}", "key 'train.eval_every'"),
    (f"logging.log_every={BIG}", "key 'logging.log_every'"),
    ("train.seed=" + "9" * 5000, "--set train.seed: not a value zaya reads"),
]


@pytest.mark.parametrize(("override", "match"), OUT_OF_RANGE, ids=[o[:40] for o, _ in OUT_OF_RANGE])
def test_every_number_of_the_run_config_is_in_its_range(base, override, match):
    message = _refused(base, [override], match)
    assert len(message) < 400  # a 400-digit value is described, not echoed


@pytest.mark.parametrize(("key", "value", "match"), [
    ("tokens", BIG, "key 'phases.0.tokens' must be an integer in 0..4,611,686,018,427,387,904"),
    ("lr_scale", "1e30", "key 'phases.0.lr_scale' must be a number in (0, 10]"),
    ("rope_theta", "1e-300", "key 'phases.0.rope_theta' must be a number in 0 or [1, 1e+12]"),
    ("cp", "100000", "key 'phases.0.cp'"),
    ("seq_len", "8192", "key 'phases.0.seq_len' = 8,192 is longer than model.max_position_embeddings = 4,096"),
    ("name", '"../x"', "key 'phases.0.name' = '../x': a phase's name is printable, without '/'"),
    ("name", '"a\\nb"', "key 'phases.0.name'"),
])
def test_the_numbers_and_names_of_phases_are_checked(tmp_path, key, value, match):
    path = tmp_path / "run.toml"
    path.write_text(PHASES, encoding="utf-8")
    _refused(path, [f"phases.0.{key}={value}"], match)


def test_sequences_longer_than_the_model_is_meant_for_are_refused(base):
    _refused(base, ["data.seq_len=8192"], "key 'data.seq_len' = 8,192 is longer than model.max_position_embeddings "
             "= 4,096")
    config = load_config(base, ["data.seq_len=8192", "model.max_position_embeddings=8192"])  # raised: it trains
    assert config.resolved_phases()[0].seq_len == 8192


@pytest.mark.parametrize(("overrides", "match"), [
    # parsed as `v = VALUE`, a line break used to end the value and drop (or add) what followed it
    (["optim.lr=3e-3\ntrain.max_steps = 5"], "a value may not hold a line break"),
    (["data.path=a\rb"], "a value may not hold a line break"),
    (["phases.0.name=x"], "has no [[phases]]; add the entries to the file"),
    (["phases.0.sources.0.weight=2"], "has no [[phases]]"),
    (["train.seed=" + "[" * 100_000], "nested more than 64 deep"),
    (["train.seed=" + "[" * 70 + "]" * 70], "nested more than 64 deep"),
    (["phases=5"], "key 'phases' must be an array of tables, got an integer"),
    (["phases=[1]"], "'phases.0' must be a table, got an integer"),
    (['phases=[{sources = "x"}]'], "key 'phases.0.sources' must be an array of tables, got a string"),
    (['phases=[{sources = [{path = 1}]}]'], "key 'phases.0.sources.0.path' must be a string, got 1"),
    (["train.max_steps={a = {b = 1}}"], "key 'train.max_steps' must be an integer, got an object"),
    (["optim.adamw_betas=[[0.9], 0.9]"], "key 'optim.adamw_betas.0' must be a number, got a list"),
    (['checkpoint.dir="a\\u0000b"'], "key 'checkpoint.dir' holds a NUL character"),
])
def test_set_values_and_wrong_types_are_one_line(base, overrides, match):
    _refused(base, overrides, match)


def test_set_names_an_entry_of_phases_the_file_has(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(PHASES, encoding="utf-8")
    _refused(path, ["phases.5.seq_len=32"], "'phases' of")
    assert load_config(path, ["phases.1.seq_len=32"]).phases[1].seq_len == 32


def test_wrong_types_in_the_file_name_the_key(tmp_path):
    model = '[model]\npreset = "micro"\n'
    cases = {
        BASE + '[[phases]]\nsources = "x"\n': "key 'phases.0.sources' must be an array of tables",
        BASE + '[[phases]]\nsources = [{path = 1}]\n': "key 'phases.0.sources.0.path' must be a string",
        BASE + "[train]\nseed = { a = 1 }\n": "key 'train.seed' must be an integer, got an object",
        "train = 5\n" + BASE: "'train' must be a table, got an integer",  # its max_steps is looked up first
        "phases = 5\n" + BASE: "key 'phases' must be an array of tables",
        BASE + '[train]\n"a\\nb" = 1\n': "unknown key 'train.a\\nb'",
        model + "[optim]\nadamw_betas = " + "[" * 80 + "]" * 80 + "\n": "nested more than 64 deep",
        model + '[data]\npath = "d"\nseq_len = 64\n[model2]\n': "unknown key 'model2'",
    }
    path = tmp_path / "run.toml"
    for text, match in cases.items():
        path.write_text(text, encoding="utf-8")
        _refused(path, [], match)


@pytest.mark.parametrize("kind", ["/dev/zero", "/dev/urandom", "fifo", "directory"])
def test_a_config_that_is_no_regular_file_is_one_line_without_waiting(tmp_path, cli, kind):
    path = Path(kind) if kind.startswith("/dev/") else tmp_path / "run.toml"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: reading would wait for one for ever
    elif kind == "directory":
        path.mkdir()
    code, _, err = cli("train", path, "--run-dir", tmp_path / "run")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "not a regular file" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_run_directories_that_cannot_be_are_refused_before_anything_is_written(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {"": "--run-dir '': empty", "  ": "empty", str(loop): "a loop of symbolic links",
             str(tmp_path / ("x" * 300)): "file name too long", str(dangling): "a symbolic link to nothing",
             str(fifo): "is not a directory", str(afile): "the run directory is a file", "a\0b": "NUL character"}
    before = sorted(tmp_path.iterdir())
    for run_dir, match in cases.items():
        with pytest.raises(ZayaError, match=match):
            check_run_dir(run_dir)
    assert sorted(tmp_path.iterdir()) == before and check_run_dir(tmp_path / "new") == tmp_path / "new"


@pytest.mark.parametrize(("device", "match"), [
    ("meta", "device 'meta': holds no data"), ("cpu:5", "the CPU is one device"), ("disk", "not a device name"),
    ("ipu", "zaya runs on cpu and cuda"), ("x" * 10_000, "not a device name"),
])
def test_devices_that_compute_nothing_are_refused(device, match):
    with pytest.raises(ZayaError, match=match) as error:
        resolve_device(device)
    assert len(str(error.value)) < 200


def test_the_trainer_refuses_a_meta_device_before_it_writes(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"device": "meta"}))
    with pytest.raises(ZayaError, match="device 'meta'"):
        build_trainer(config, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # not even the lock file


# ---- what the trainer reads back ------------------------------------------------------------------------


def _checkpoint(tmp_path: Path, info: dict | None, progress: dict | None, saved: dict) -> Path:
    directory = tmp_path / "step_00000004"
    directory.mkdir()
    (directory / ckpt.INFO_FILE).write_text(json.dumps({"version": 2, "step": 4, "precision": "fp32", **(info or {})}))
    body = {"state": {"step": 4, "phase": 0, **(progress or {})}, "optimizer": {"dict": []}, "config": {}, **saved}
    (directory / ckpt.TRAIN_STATE_FILE).write_text(json.dumps(body))
    return directory


@pytest.mark.parametrize(("info", "state", "saved", "match"), [
    ({"step": 2**70}, None, {}, "zaya.json: field 'step' must be an integer in 0.."),
    ({"step": "4"}, None, {}, "field 'step'"),
    ({"precision": 16}, None, {}, "field 'precision' must be a string"),
    ({"precision": "fp8"}, None, {}, "field 'precision' must be one of 'bf16', 'fp32'"),
    (None, {"phase": -1}, {}, "field 'state.phase'"),
    (None, {"tokens": 1.5}, {}, "field 'state.tokens'"),
    (None, {"loaders": 5}, {}, "field 'state.loaders' must be an object"),
    (None, {"loaders": {"main": {"consumed_samples": "x"}}}, {}, "field 'state.loaders.main.consumed_samples'"),
    (None, {"fingerprints": {"main": [1]}}, {}, "field 'state.fingerprints.main.0' must be a string"),
    (None, {"train_seconds": "x"}, {}, "field 'state.train_seconds' must be a finite number"),
    (None, {"step_times": [1, "x"]}, {}, "field 'state.step_times.1'"),
    (None, {"step_times": [-1.0]}, {}, "must not be negative"),
    (None, None, {"optimizer": {"tensor": 1}}, "field 'optimizer.tensor' must be a string"),
    (None, None, {"optimizer": {"dict": [["a"]]}}, "field 'optimizer.dict' must be a list of [key, value] pairs"),
    (None, None, {"optimizer": {"list": [{"x": 1}]}}, "field 'optimizer.list.0' is not a part of"),
    (None, None, {"state": []}, "field 'state' must be an object"),
    (None, None, {"config": 5}, "field 'config' must be an object"),
])
def test_a_checkpoint_s_json_of_the_wrong_types_is_one_line(tmp_path, info, state, saved, match):
    directory = _checkpoint(tmp_path, info, state, saved)
    with pytest.raises(ZayaError, match=match.replace("[", r"\[").replace("]", r"\]")):
        check_resumable(directory)


def test_an_rng_state_torch_cannot_take_is_refused(tmp_path):
    good = ckpt.rng_state()
    check_rng(good, tmp_path / "rng.rank0.json")
    for bad in ({**good, "torch": "AAAA"}, {**good, "python": [3, [1] * 625 + [2**40], None]},
                {**good, "python": [2, good["python"][1], None]}, {**good, "cuda": [5]}, {**good, "torch": 7}):
        with pytest.raises(ZayaError, match="not a random-number generator state"):
            check_rng(bad, tmp_path / "rng.rank0.json")


def test_the_metrics_log_is_read_with_bounds_and_cut_in_place(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    log.write_text("\n".join(rows) + "\n" + "x" * (17 << 20) + "\n" + rows[0] + "\n")  # a line over the bound
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    truncate_metrics(tmp_path, 2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2] and log.stat().st_size < 100
    log.write_text('{"step": "one"}\n')
    with pytest.raises(ZayaError, match="not a metrics log"):
        read_metrics(tmp_path)


def _fifo_is_refused(call, path: Path) -> None:
    """`call()` refuses the FIFO at `path` in one line, without waiting for a writer or a reader."""
    os.mkfifo(path)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_error(call)), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), f"waited on the FIFO {path}"
    assert result and result[0] is not None and "\n" not in result[0], result


def _error(call) -> str | None:
    try:
        call()
    except ZayaError as exc:
        return str(exc)
    return None


def test_the_run_s_own_files_are_never_written_through_a_link_nor_waited_on(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious data")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "run_config.json", "train.log", "wandb-id.txt"):
        (run / name).symlink_to(outside)
    with pytest.raises(ZayaError, match=r"metrics\.jsonl: cannot rewrite the metrics log"):
        truncate_metrics(run, 0)
    with pytest.raises(ZayaError, match="refusing to replace it"):
        record_start(run, {"a": 1}, None, 0)
    with pytest.raises(ZayaError, match=r"train\.log: a symbolic link"):
        RunLog(run, 0)("hello")
    with pytest.raises(ZayaError, match="not a W&B run id"):
        run_id(run)  # the link is read (bounded), and what it holds is no id
    assert outside.read_text() == "precious data"
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    _fifo_is_refused(lambda: read_metrics(fifos), fifos / "metrics.jsonl")
    _fifo_is_refused(lambda: run_id(fifos), fifos / "wandb-id.txt")
    _fifo_is_refused(lambda: RunLog(fifos, 0)("hello"), fifos / "train.log")
    (fifos / "big").mkdir()
    (fifos / "big" / "wandb-id.txt").write_text("a" * (1 << 20))
    with pytest.raises(ZayaError, match="larger than 4 KiB"):
        run_id(fifos / "big")


# ---- a run that turns NaN --------------------------------------------------------------------------------


def test_a_checkpoint_of_nan_is_never_written():
    finite, broken = [torch.ones(3), torch.zeros(0)], [torch.ones(3), torch.tensor([1.0, float("inf")])]
    reduced = []
    check_finite(4, finite, finite, torch.device("cpu"), reduced.append)
    assert len(reduced) == 1  # one reduction for the model and the optimizer together
    with pytest.raises(ZayaError, match="step 4: the optimizer's state hold NaN or infinite values"):
        check_finite(4, finite, broken, torch.device("cpu"), lambda t: None)
    nan = [torch.tensor([float("nan")], dtype=torch.bfloat16)]
    with pytest.raises(ZayaError, match="the model's weights and the optimizer's state hold NaN"):
        check_finite(4, nan, broken, torch.device("cpu"), lambda t: None)


def test_a_run_that_is_nan_from_its_first_step_stops_at_once_without_a_checkpoint(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 3, "eval_every": 0},
                                      checkpoint={"every": 1}))
    run = tmp_path / "run"
    trainer = build_trainer(config, run, environ={"ZAYA_FAULTS": "nan@step:0"})
    with pytest.raises(ZayaError, match=r"step 0: non-finite gradient norm \(nan\).*nothing to skip back to"):
        trainer.run()
    assert not list(run.glob("checkpoints/step_*"))
    (incident,) = read_incidents(run / "incidents.jsonl")
    assert incident["signal"] == "nan" and incident["action"] == "stop"


def test_weights_that_became_nan_are_never_committed(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2, "eval_every": 0},
                                      checkpoint={"every": 1}))
    run = tmp_path / "run"
    trainer = None

    def poison(event: str, step: int, path=None) -> None:  # as a learning rate far too large would, after step 1
        if event == "checkpoint_save" and step == 2:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))

    trainer = build_trainer(config, run, hooks=Hooks([poison], []))
    with pytest.raises(ZayaError, match="step 2: the model's weights hold NaN or infinite values"):
        trainer.run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def test_a_run_that_ends_on_skipped_steps_fails_without_a_final_checkpoint(dataset, tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", dataset, train={"max_steps": 2, "eval_every": 0},
                                      checkpoint={"every": 1}))
    run = tmp_path / "run"
    with pytest.raises(ZayaError, match="step 2: the run ends on 1 non-finite step"):
        build_trainer(config, run, environ={"ZAYA_FAULTS": "nan@step:1"}).run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001"]
