"""What a run is checked against before anything is written: its datasets, the checkpoint it resumes, and the
weights it starts from.

Every rank runs these checks on its own, inside the job's start-up check (`zaya.parallel.launch`), so that bad
input stops every rank at once with one line: a dataset that is missing or does not fit the model's vocabulary,
a checkpoint of a format this version cannot resume, data that changed since the checkpoint, weights to start
from (`train.init_from`) that are missing or of another model's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from zaya import checkpoint as ckpt
from zaya.data.dataset_reader import open_dataset
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.errors import ZayaError
from zaya.run_dir import CHECKPOINTS_DIR
from zaya.train.config import CheckpointSection
from zaya.train.run import ResolvedRun
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
    return ckpt.CheckpointManager(directory, keep=1 << 30, rank=rank).newest_valid(log=log)


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
    """The weights a fresh run starts from (`train.init_from`), checked against the run's model, and a note for
    each setting that differs without changing a shape; None for a run that resumes or starts at random."""
    if not run.train.init_from or resume_from is not None:
        return None, []
    try:
        source = WeightSource.open(run.train.init_from)
    except ZayaError as exc:
        raise ZayaError(f"{INIT_KEY}: {exc}") from None
    return source, source.check_fits(run.model, INIT_KEY)


def saved_phase(checkpoint: Path | None, phases: int) -> int:
    """The phase a checkpoint was taken in (0 for none), within the `phases` the config has now."""
    if checkpoint is None:
        return 0
    state = ckpt.read_json(checkpoint / ckpt.TRAIN_STATE_FILE)["state"]
    return min(int(state.get("phase", 0)), phases - 1)


def check_inputs(run: ResolvedRun, resume_from: Path | None, allow_data_change: bool = False,
                 allow_tokenizer_change: bool = False) -> list[str]:
    """Every phase's datasets exist and fit the model's vocabulary; a checkpoint to resume is of this format
    version, was trained on the same data (unless `allow_data_change`) and with the same tokenizer (unless
    `allow_tokenizer_change`: other ids for the same text make the trained model a stranger to its data).
    Returns warnings: a model vocabulary larger than the data's needs (rows that are never trained)."""
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
        return notes
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
    return notes
