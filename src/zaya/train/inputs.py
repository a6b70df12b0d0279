"""What a run is checked against before anything is written: its datasets, the checkpoint it resumes, and the
weights it starts from.

Every rank runs these checks on its own, inside the job's start-up check (`zaya.parallel.launch`), so that bad
input stops every rank at once with one line: a dataset that is missing or does not fit the model's vocabulary,
a checkpoint of a format this version cannot resume, data that changed since the checkpoint, weights to start
from (`train.init_from`) that are missing or of another model's shape, and a checkpoint resumed or weights
started from that were trained on another tokenizer than the data's (`zaya.tokenizer_source`: compared by
content, refused unless `--allow-tokenizer-change`, which is then said in the log).
"""

from __future__ import annotations

import binascii
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zaya import checkpoint as ckpt
from zaya.data.dataset_reader import open_dataset
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.run_dir import CHECKPOINTS_DIR
from zaya.schema import Fields, shown
from zaya.tokenizer_source import ALLOW_FLAG, check_same_tokenizer
from zaya.train.checkpointing import Progress, check_skeleton
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


# the bound of every count a checkpoint's state holds (steps, tokens, samples): as a run config's (zaya.config)
COUNT = 2**62
_TIMES = 1024  # recent step times a clock keeps (it keeps 10)
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class SavedRun:
    """What a resume reads of a checkpoint besides its tensors, each field typed (`read_saved`)."""

    step: int
    version: Any  # compared with the version this code resumes (`check_inputs`)
    precision: str | None  # None in a checkpoint written before it was recorded
    world_size: int
    progress: Progress
    clock: Clock
    optimizer: dict  # the optimizer's skeleton (`zaya.train.checkpointing.split_tensors`)
    config: dict  # the resolved run config it recorded ({} if none)


def read_saved(directory: Path) -> SavedRun:
    """zaya.json and train_state.json of checkpoint `directory`, typed: a field of the wrong type or out of range is
    one `ZayaError` naming the file and the field."""
    info_path, state_path = directory / ckpt.INFO_FILE, directory / ckpt.TRAIN_STATE_FILE
    info = Fields(ckpt.read_json(info_path), info_path)
    saved = Fields(ckpt.read_json(state_path), state_path)
    state = saved.obj("state")
    skeleton = saved.dict("optimizer")
    check_skeleton(skeleton, state_path)
    return SavedRun(step=info.int("step", lo=0, hi=COUNT), version=info.data.get("version"),
                    precision=None if info.data.get("precision") is None else info.str("precision", choices=PRECISIONS),
                    world_size=info.int("world_size", 1, lo=1, hi=2**20), progress=_progress(state),
                    clock=_clock(state), optimizer=skeleton, config=saved.dict("config", None) or {})


def _progress(state: Fields) -> Progress:
    counts = {name: state.int(name, 0, lo=0, hi=COUNT) for name in ("step", "phase", "phase_tokens", "tokens",
                                                                      "samples")}
    loaders = state.dict("loaders", {}, of=dict)
    for name in loaders:
        loader = state.obj("loaders").obj(name)
        loader.int("consumed_samples", lo=0, hi=COUNT)
        loader.list("skip_ranges", [], of=list)
    fingerprints = state.dict("fingerprints", {}, of=list)
    for name in fingerprints:
        state.obj("fingerprints").list(name, of=str, max_len=1 << 16)
    return Progress(**counts, loaders=loaders, fingerprints=fingerprints)


def _clock(state: Fields) -> Clock:
    times = {name: [float(t) for t in state.list(name, [], of=(int, float), max_len=_TIMES)]
             for name in ("step_times", "sample_times")}
    if any(t < 0 for ts in times.values() for t in ts):
        raise ZayaError(f"{state.source}: field 'state.step_times' and 'state.sample_times' must not be negative")
    seconds = {name: state.float(name, 0.0, lo=0.0) for name in ("train_seconds", "save_seconds", "eval_seconds")}
    # a checkpoint from before the budget counted wall time: its steps' time is what it had spent
    seconds["run_seconds"] = state.float("run_seconds", seconds["train_seconds"], lo=0.0)
    return Clock(**seconds, decay_start=state.int("decay_start", 0, lo=0, hi=COUNT),
                 schedule_steps=state.int("schedule_steps", 0, lo=0, hi=COUNT), **times)


def check_resumable(directory: Path) -> None:
    """What a resume reads besides the tensors holds values of the right types, or `ZayaError` naming the file
    and field: a checkpoint whose files match their checksums but could not be resumed from is set aside like a
    damaged one, and training falls back to the one before."""
    read_saved(directory)
    for rng in sorted(directory.glob("rng.rank*.json")):
        check_rng(ckpt.read_json(rng), rng)


def check_rng(data: dict, path: Path) -> None:
    """`data` (rng.rankR.json) is a random-number generator state this process can take: torch's of the size its own
    has, Python's of version 3 with 625 words, and the accelerators' as base64."""
    doc = Fields(data, path)
    try:
        cpu = binascii.a2b_base64(doc.str("torch", max_len=1 << 20).encode("ascii"), strict_mode=True)
        for state in doc.list("cuda", [], of=str, max_len=1 << 12):
            binascii.a2b_base64(state.encode("ascii"), strict_mode=True)
        version, internal, gauss = doc.list("python", of=(int, list, float, type(None)))
        good = (len(cpu) == torch.get_rng_state().numel() and version == 3 and isinstance(internal, list)
                and len(internal) == 625 and all(_word(w) for w in internal)
                and (gauss is None or isinstance(gauss, float)))
    except (ZayaError, TypeError, ValueError, UnicodeEncodeError):
        good = False
    if not good:
        raise ZayaError(f"{path}: not a random-number generator state")


def _word(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def recorded_precision(checkpoint: Path | None) -> str | None:
    """The precision the run of `checkpoint` trained in ("bf16" or "fp32"), which a resume of `auto` keeps: the
    checkpoint's own record, or, in one written before it had one, the resolved config it carries."""
    if checkpoint is None:
        return None
    saved = read_saved(checkpoint)
    if saved.precision is not None:
        return saved.precision
    train = saved.config.get("train")
    precision = train.get("precision") if isinstance(train, dict) else None
    return precision if isinstance(precision, str) and precision in PRECISIONS else None


def init_source(run: ResolvedRun, resume_from: Path | None,
                allow_tokenizer_change: bool = False) -> tuple[WeightSource | None, list[str]]:
    """The weights a fresh run starts from (`train.init_from`, or its first phase's), checked against the run's
    model and the first phase's data (the same tokenizer, unless `allow_tokenizer_change`), and a note for each
    setting that differs without changing a shape; None for a run that resumes or starts at random."""
    path, key = run.train.init_from, INIT_KEY
    if not path and run.phases[0].init_from:
        path, key = run.phases[0].init_from, "phases.0.init_from"
    if not path or resume_from is not None:
        return None, []
    return _open_source(path, key, run, 0, allow_tokenizer_change)


def phase_sources(run: ResolvedRun, resume_from: Path | None,
                  allow_tokenizer_change: bool = False) -> tuple[dict[int, WeightSource], list[str]]:
    """The weights each later phase starts from (`init_from` of a phase after the first), by phase index, for the
    phases still ahead of the run; opened and checked now (against the model and the phase's data), so that a
    bad path or another tokenizer stops the run before it trains, not at the phase's start hours later."""
    reached = saved_phase(resume_from, len(run.phases))
    sources, notes = {}, []
    for index, phase in enumerate(run.phases):
        if index > 0 and phase.init_from and index > reached:
            sources[index], said = _open_source(phase.init_from, f"phases.{index}.init_from", run, index,
                                                allow_tokenizer_change)
            notes += said
    return sources, notes


def _open_source(path: str, key: str, run: ResolvedRun, phase: int,
                 allow_tokenizer_change: bool) -> tuple[WeightSource, list[str]]:
    try:
        source = WeightSource.open(path)
    except ZayaError as exc:
        raise ZayaError(f"{key}: {exc}") from None
    notes = source.check_fits(run.model, key)
    carried = source.tokenizer
    for data in dict.fromkeys(open_dataset(s.path).tokenizer_path for s in run.phases[phase].sources):
        said = check_same_tokenizer(key, source.path, carried, data, allow=allow_tokenizer_change,
                                    fix=f"build the data with --tokenizer {path}, or pass {ALLOW_FLAG}")
        if said is not None:
            notes.append(said)
        if carried is None:
            break  # one note says it
    return source, notes


def saved_phase(checkpoint: Path | None, phases: int) -> int:
    """The phase a checkpoint was taken in (0 for none), within the `phases` the config has now."""
    if checkpoint is None:
        return 0
    return min(read_saved(checkpoint).progress.phase, phases - 1)


def check_inputs(run: ResolvedRun, resume_from: Path | None, allow_data_change: bool = False,
                 allow_tokenizer_change: bool = False) -> tuple[list[str], dict[str, list[str]]]:
    """Every phase's datasets exist and fit the model's vocabulary; a checkpoint to resume is of this format
    version, was trained on the same data (unless `allow_data_change`) and with the same tokenizer (unless
    `allow_tokenizer_change`: other ids for the same text make the trained model a stranger to its data; compared
    by content, and said when allowed). Returns warnings (a model vocabulary larger than the data's needs: rows
    that are never trained) and each phase's dataset fingerprints."""
    fingerprints, tokenizers, notes = {}, {}, []
    started = _starts_from(run)
    for phase in run.phases:
        for source in phase.sources:
            if not Path(source.path).exists():
                raise ZayaError(f"{source.path}: no such dataset directory (paths are relative to {Path.cwd()}); "
                                f"build it with: zaya data build --input YOUR_TEXT_FILES_OR_DIRS --out {source.path}")
        datasets = [open_dataset(source.path) for source in phase.sources]  # clear errors if anything else is wrong
        for dataset in datasets:
            if started and dataset.max_token_id >= run.model.vocab_size:
                # a larger model would not load those weights: the data is what does not fit
                raise ZayaError(f"{dataset.path}: token id {dataset.max_token_id} does not fit the vocabulary of "
                                f"{run.model.vocab_size} that the weights of {started[0]} have: the data was built "
                                f"with another tokenizer than theirs; build it with --tokenizer {started[1]}")
            dataset.check_vocab(run.model.vocab_size)
        largest = max(dataset.vocab_size for dataset in datasets)
        fitted = -(-largest // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if fitted < run.model.vocab_size and not notes:
            unused = (f"model.vocab_size is {run.model.vocab_size}, but the data's tokenizer has {largest} tokens "
                      f"({datasets[0].path}): {run.model.vocab_size - largest} embedding rows will never be trained")
            # weights to start from fix the vocabulary: another size would be a model of another shape
            notes.append(f"note: {unused}; they come with the weights of {started[0]}, whose shape the run keeps"
                         if started else f"warning: {unused}; set model.vocab_size = {fitted} (the data's, rounded "
                         f"up to a multiple of {VOCAB_MULTIPLE}) to save them")
        fingerprints[phase.name] = [dataset.fingerprint for dataset in datasets]
        tokenizers[phase.name] = datasets[0].tokenizer_path
    if resume_from is None:
        return notes, fingerprints
    saved = read_saved(resume_from)
    if saved.version != ckpt.VERSION or isinstance(saved.version, bool):
        raise ZayaError(f"{resume_from}: a checkpoint of format version {shown(saved.version)}, whose optimizer state "
                        f"this version ({ckpt.VERSION}) cannot resume; its model still loads (zaya convert, "
                        "zaya.load_model)")
    for phase in run.phases:
        now, before = fingerprints[phase.name], saved.progress.fingerprints.get(phase.name)
        if before is not None and before != now and not allow_data_change:
            said = before[0][:12] if before else "(none)"
            raise ZayaError(f"{resume_from}: phase '{phase.name}' was trained on data {said}..., but the config now "
                            f"gives {now[0][:12]}...; pass --allow-data-change to continue anyway")
    trained_with = resume_from / TOKENIZER_FILE
    phase = run.phases[min(saved.progress.phase, len(run.phases) - 1)]
    if trained_with.is_file():  # a checkpoint older than the tokenizer in it has nothing to compare
        said = check_same_tokenizer("resume", resume_from, trained_with, tokenizers[phase.name],
                                    allow=allow_tokenizer_change, fix=f"pass {ALLOW_FLAG} to continue anyway")
        if said is not None:
            notes.append(said)
    return notes, fingerprints


def _starts_from(run: ResolvedRun) -> tuple[str, str] | None:
    """The config key and path of the first weights the run starts from (`train.init_from`, a phase's), if any."""
    if run.train.init_from:
        return INIT_KEY, run.train.init_from
    return next(((f"phases.{i}.init_from", phase.init_from) for i, phase in enumerate(run.phases)
                 if phase.init_from), None)


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
