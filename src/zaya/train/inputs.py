"""What a run is checked against before anything is written: its datasets, the checkpoint it resumes, and the
weights it starts from.

Every rank runs these checks on its own, inside the job's start-up check (`zaya.parallel.launch`), so that bad
input stops every rank at once with one line: a dataset that is missing or does not fit the model's vocabulary,
a checkpoint of a format this version cannot resume, data that changed since the checkpoint, weights to start
from (`train.init_from`) that are missing or of another model's shape.
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from zaya import checkpoint as ckpt
from zaya.data.dataset_reader import open_dataset
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.optim.config import finite_number
from zaya.run_dir import CHECKPOINTS_DIR
from zaya.train.checkpointing import Progress
from zaya.train.config import CheckpointSection
from zaya.train.run import ResolvedRun
from zaya.train.stops import Clock
from zaya.weights import WeightSource

INIT_KEY = "train.init_from"
VOCAB_MULTIPLE = 128  # a vocabulary fitted to the data is rounded up to this: the LM head's GEMMs like it


def checkpoint_dir(section: CheckpointSection, run_dir: Path) -> Path:
    """Where the run's checkpoints go: `checkpoint.dir`, else RUN_DIR/checkpoints."""
    return Path(section.dir) if section.dir else Path(run_dir) / CHECKPOINTS_DIR


def newest_checkpoint(directory: Path, rank: int, log: Callable[[str], None]) -> Path | None:
    """The newest valid checkpoint under `directory`, if any. Before the process group exists: rank 0 alone
    renames a bad one `*.bad`."""
    if not Path(directory).is_dir():
        return None
    return ckpt.CheckpointManager(directory, keep=1 << 30, rank=rank).newest_valid(log=log, check=check_resumable)


def check_resumable(directory: Path) -> None:
    """What a resume reads besides the tensors holds values of the right types, or `ZayaError` naming the file
    and field: a checkpoint whose files match their checksums but could not be resumed from is set aside like a
    damaged one, and training falls back to the one before."""
    info = ckpt.read_json(directory / ckpt.INFO_FILE)
    if not _count(info.get("step")):
        raise ZayaError(f"{directory / ckpt.INFO_FILE}: field 'step' must be a non-negative integer, "
                        f"got {info.get('step')!r}")
    path = directory / ckpt.TRAIN_STATE_FILE
    saved = ckpt.read_json(path)
    state = saved.get("state")
    for name, value in (("state", state), ("optimizer", saved.get("optimizer"))):
        if not isinstance(value, dict):
            raise ZayaError(f"{path}: field '{name}' must be an object, got {type(value).__name__}")
    for kind in (Progress, Clock):
        defaults = kind()
        for field in dataclasses.fields(kind):
            if field.name in state and not _like(state[field.name], getattr(defaults, field.name)):
                raise ZayaError(f"{path}: field 'state.{field.name}' must be "
                                f"{type(getattr(defaults, field.name)).__name__}, got {state[field.name]!r}")
    for rng in sorted(directory.glob("rng.rank*.json")):
        _check_rng(ckpt.read_json(rng), rng)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _like(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return _count(value)
    if isinstance(default, float):
        return finite_number(value)
    return isinstance(value, type(default))


def _check_rng(data: dict, path: Path) -> None:
    try:
        binascii.a2b_base64(data["torch"].encode("ascii"), strict_mode=True)
        for state in data.get("cuda", []):
            binascii.a2b_base64(state.encode("ascii"), strict_mode=True)
        version, internal, gauss = data["python"]
        good = (isinstance(version, int) and isinstance(internal, list) and all(map(_count, internal))
                and (gauss is None or isinstance(gauss, float)))
    except (KeyError, TypeError, ValueError, AttributeError):
        good = False
    if not good:
        raise ZayaError(f"{path}: not a random-number generator state")


def recorded_precision(checkpoint: Path | None) -> str | None:
    """The precision the run of `checkpoint` trained in ("bf16" or "fp32"), which a resume of `auto` keeps: the
    checkpoint's own record, or, in one written before it had one, the resolved config it carries."""
    if checkpoint is None:
        return None
    precision = ckpt.read_json(checkpoint / ckpt.INFO_FILE).get("precision")
    if precision is None:
        record = ckpt.read_json(checkpoint / ckpt.TRAIN_STATE_FILE).get("config") or {}
        precision = (record.get("train") or {}).get("precision")
    return precision if precision in ("bf16", "fp32") else None


def init_source(run: ResolvedRun, resume_from: Path | None) -> tuple[WeightSource | None, list[str]]:
    """The weights a fresh run starts from (`train.init_from`, or its first phase's), checked against the run's
    model, and a note for each setting that differs without changing a shape; None for a run that resumes or
    starts at random."""
    path, key = run.train.init_from, INIT_KEY
    if not path and run.phases[0].init_from:
        path, key = run.phases[0].init_from, "phases.0.init_from"
    if not path or resume_from is not None:
        return None, []
    return _open_source(path, key, run)


def phase_sources(run: ResolvedRun, resume_from: Path | None) -> tuple[dict[int, WeightSource], list[str]]:
    """The weights each later phase starts from (`init_from` of a phase after the first), by phase index, for the
    phases still ahead of the run; opened and checked now, so that a bad path stops the run before it trains,
    not at the phase's start hours later."""
    reached = saved_phase(resume_from, len(run.phases))
    sources, notes = {}, []
    for index, phase in enumerate(run.phases):
        if index > 0 and phase.init_from and index > reached:
            sources[index], said = _open_source(phase.init_from, f"phases.{index}.init_from", run)
            notes += said
    return sources, notes


def _open_source(path: str, key: str, run: ResolvedRun) -> tuple[WeightSource, list[str]]:
    try:
        source = WeightSource.open(path)
    except ZayaError as exc:
        raise ZayaError(f"{key}: {exc}") from None
    return source, source.check_fits(run.model, key)


def saved_phase(checkpoint: Path | None, phases: int) -> int:
    """The phase a checkpoint was taken in (0 for none), within the `phases` the config has now."""
    if checkpoint is None:
        return 0
    state = ckpt.read_json(checkpoint / ckpt.TRAIN_STATE_FILE)["state"]
    return min(int(state.get("phase", 0)), phases - 1)


def check_inputs(run: ResolvedRun, resume_from: Path | None, allow_data_change: bool = False,
                 allow_tokenizer_change: bool = False) -> tuple[list[str], dict[str, list[str]]]:
    """Every phase's datasets exist and fit the model's vocabulary; a checkpoint to resume is of this format
    version, was trained on the same data (unless `allow_data_change`) and with the same tokenizer (unless
    `allow_tokenizer_change`: other ids for the same text make the trained model a stranger to its data).
    Returns warnings (a model vocabulary larger than the data's needs: rows that are never trained) and each
    phase's dataset fingerprints."""
    fingerprints, tokenizers, notes = {}, {}, []
    for phase in run.phases:
        for source in phase.sources:
            if not Path(source.path).exists():
                raise ZayaError(f"{source.path}: no such dataset directory (paths are relative to {Path.cwd()}); "
                                f"build it with: zaya data build --input YOUR_TEXT_FILES_OR_DIRS --out {source.path}")
        datasets = [open_dataset(source.path) for source in phase.sources]  # clear errors if anything else is wrong
        for dataset in datasets:
            dataset.check_vocab(run.model.vocab_size)
        largest = max(dataset.vocab_size for dataset in datasets)
        fitted = -(-largest // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if fitted < run.model.vocab_size and not notes:
            notes.append(f"warning: model.vocab_size is {run.model.vocab_size}, but the data's tokenizer has "
                         f"{largest} tokens ({datasets[0].path}): {run.model.vocab_size - largest} embedding rows "
                         f"will never be trained; set model.vocab_size = {fitted} (the data's, rounded up to a "
                         f"multiple of {VOCAB_MULTIPLE}) to save them")
        fingerprints[phase.name] = [dataset.fingerprint for dataset in datasets]
        tokenizers[phase.name] = datasets[0].tokenizer_path
    if resume_from is None:
        return notes, fingerprints
    version = ckpt.read_json(resume_from / ckpt.INFO_FILE).get("version")
    if version != ckpt.VERSION:
        raise ZayaError(f"{resume_from}: a checkpoint of format version {version}, whose optimizer state this "
                        f"version ({ckpt.VERSION}) cannot resume; its model still loads (zaya convert, "
                        "zaya.load_model)")
    saved = ckpt.read_json(resume_from / ckpt.TRAIN_STATE_FILE)["state"]
    for phase in run.phases:
        now, before = fingerprints[phase.name], saved.get("fingerprints", {}).get(phase.name)
        if before is not None and before != now and not allow_data_change:
            raise ZayaError(f"{resume_from}: phase '{phase.name}' was trained on data {before[0][:12]}..., but the "
                            f"config now gives {now[0][:12]}...; pass --allow-data-change to continue anyway")
    trained_with = resume_from / TOKENIZER_FILE
    phase = run.phases[min(int(saved.get("phase", 0)), len(run.phases) - 1)]
    if trained_with.is_file() and not allow_tokenizer_change:
        now = tokenizers[phase.name]
        if trained_with.read_bytes() != now.read_bytes():
            raise ZayaError(f"{resume_from}: the run was trained with another tokenizer than {now} (the same "
                            "text becomes other token ids); pass --allow-tokenizer-change to continue anyway")
    return notes, fingerprints


def check_ranks_agree(run: ResolvedRun, gather: Callable[[str, str], list[str]],
                      fingerprints: dict[str, list[str]]) -> None:
    """Every rank resolved the same run from the same data, or every rank raises `ZayaError` naming the first
    setting that differs (a rank with another config file, `--set` or dataset would otherwise hang in a
    collective, fail in one, or train on other data unnoticed). `gather(name, value)` is every rank's value;
    `fingerprints` the phases' datasets' (`check_inputs`)."""
    text = json.dumps(run_settings(run, fingerprints), sort_keys=True, default=str)
    digests = gather("run-fingerprint", hashlib.sha256(text.encode()).hexdigest())
    if len(set(digests)) > 1:  # rare: only then does every rank send the whole of its settings
        raise ZayaError(disagreement([json.loads(t) for t in gather("run-settings", text)]))


def run_settings(run: ResolvedRun, fingerprints: dict[str, list[str]]) -> dict:
    """The resolved config and each phase's dataset fingerprints (`check_inputs`), flat:
    {"config.optim.lr": 0.01, ...}."""
    return _flat({"config": run.record, "data": fingerprints})


def disagreement(settings: list[dict]) -> str:
    """What the first rank whose settings differ from rank 0's says differently, in the first key that differs."""
    other = next(r for r, theirs in enumerate(settings) if theirs != settings[0])
    first, theirs = settings[0], settings[other]
    key = min(k for k in {*first, *theirs} if first.get(k) != theirs.get(k))
    return (f"the ranks disagree on {key}: {first.get(key, '(unset)')!r} on rank 0, {theirs.get(key, '(unset)')!r} "
            f"on rank {other}; every rank needs the same config and data")


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}
