"""Checkpoints on disk, for training and inference alike: the files and their checks (`files`), tensors in and out
through torch.distributed.checkpoint (`tensors`), and training checkpoints with their commit protocol
(`manager`)."""

from zaya.checkpoint.files import (
    FORMAT,
    INFO_FILE,
    LATEST_FILE,
    METADATA_FILE,
    MODEL_VERSIONS,
    STEP_MARKER,
    TRAIN_STATE_FILE,
    VERSION,
    drop_from_page_cache,
    is_checkpoint,
    is_zaya_checkpoint,
    prewarm,
    read_json,
    read_metadata,
    verify_checkpoint,
    write_json,
    write_manifest,
    zaya_made,
)
from zaya.checkpoint.manager import STEP_DIR, CheckpointManager, resolve_checkpoint
from zaya.checkpoint.tensors import (
    load_model_weights,
    load_tensors,
    read_checkpoint_config,
    rng_state,
    save_model_checkpoint,
    set_rng_state,
)

__all__ = [
    "FORMAT",
    "INFO_FILE",
    "LATEST_FILE",
    "METADATA_FILE",
    "MODEL_VERSIONS",
    "STEP_DIR",
    "STEP_MARKER",
    "TRAIN_STATE_FILE",
    "VERSION",
    "CheckpointManager",
    "drop_from_page_cache",
    "is_checkpoint",
    "is_zaya_checkpoint",
    "load_model_weights",
    "load_tensors",
    "prewarm",
    "read_checkpoint_config",
    "read_json",
    "read_metadata",
    "resolve_checkpoint",
    "rng_state",
    "save_model_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
    "write_json",
    "write_manifest",
    "zaya_made",
]
