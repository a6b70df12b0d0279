"""Which tokenizer a thing carries, and whether a model and the data it meets share one.

A tokenizer.json is found in the same place in a dataset, a zaya checkpoint and a Hugging Face export: at the
top of the directory. A run directory carries its newest valid checkpoint's (chosen as `zaya.weights` chooses
the weights to load). `tokenizer_file` resolves any of them, so that a chat build can reuse the tokenizer of the
run it will fine-tune (`zaya data build --format chat --tokenizer runs/base`).

A model trained on one tokenizer's ids and fed another's reads every token as some other word: it trains or
evaluates without an error and means nothing. `check_same_tokenizer` compares the two by content
(`zaya.data.tokenizer.content_fingerprint`), for `train.init_from`, a phase's `init_from`, a resume and `zaya eval
--data`: a mismatch is one line naming both files and their fingerprints, unless the user allows it, which is
then said; a model that carries no tokenizer (an older checkpoint, an HF directory without one) cannot be
checked, and that is said too.

Only `tokenizers` is needed for a file or a directory holding one; `zaya.weights` (and torch) is imported to
resolve a run directory alone.
"""

from __future__ import annotations

from pathlib import Path

from zaya.data.tokenizer import TOKENIZER_FILE, find_tokenizer, tokenizer_fingerprint
from zaya.errors import ZayaError
from zaya.reading import os_reason, read_bytes

ALLOW_FLAG = "--allow-tokenizer-change"
_SHORT = 12  # hex digits of a fingerprint in messages


def tokenizer_file(path: str | Path, flag: str = "--tokenizer") -> Path:
    """The tokenizer.json that `path` is or carries: the file itself, the one at the top of a dataset, checkpoint
    or Hugging Face directory, or the newest valid checkpoint's of a run directory; else one `ZayaError` naming
    `flag` and the path."""
    path = Path(path)
    try:
        is_dir = path.is_dir()
        exists = path.exists()
    except (OSError, ValueError) as exc:  # a name too long, a NUL character
        reason = os_reason(exc) if isinstance(exc, OSError) else "not a usable path"
        raise ZayaError(f"{flag} {path}: {reason}") from None
    if not exists:
        raise ZayaError(f"{flag} {path}: no such file or directory")
    if not is_dir:
        return path
    found = find_tokenizer(path)
    if found is not None:
        return found
    from zaya.weights import model_dir_kind, resolve_model_dir

    try:
        kind = model_dir_kind(path)
    except ZayaError:
        kind = None
    if kind == "checkpoint":
        raise ZayaError(f"{flag} {path}: a checkpoint that carries no {TOKENIZER_FILE}; give the {TOKENIZER_FILE} "
                        "or the dataset it was trained on")
    if kind == "hf":
        raise ZayaError(f"{flag} {path}: a Hugging Face directory without a {TOKENIZER_FILE}")
    if kind != "run":
        raise ZayaError(f"{flag} {path}: no {TOKENIZER_FILE} there; give a {TOKENIZER_FILE}, or a dataset, "
                        "checkpoint, Hugging Face export or run directory that holds one")
    try:
        directory, _ = resolve_model_dir(path)
    except ZayaError as exc:  # no valid checkpoint in the run
        raise ZayaError(f"{flag} {exc}") from None
    found = find_tokenizer(directory)
    if found is None:
        raise ZayaError(f"{flag} {path}: its newest valid checkpoint, {directory}, carries no {TOKENIZER_FILE}")
    return found


def short(fingerprint: str) -> str:
    """A fingerprint as messages show it."""
    return fingerprint[:_SHORT]


def check_same_tokenizer(where: str, model: Path, carried: Path | None, data: Path, *, allow: bool,
                         fix: str) -> str | None:
    """Compare the tokenizer `carried` by the model at `model` with the data's tokenizer.json at `data`, by
    content. The same: None. Different: `ZayaError` in one line starting with `where` (a config key, a flag, a
    checkpoint) and ending with `fix` (what to do instead), or with `allow` a warning line saying both. No
    tokenizer carried: a note line (nothing to compare with)."""
    if carried is None:
        return (f"note: {where}: {model} carries no {TOKENIZER_FILE}, so whether it was trained on the tokenizer "
                f"of the data ({data}) cannot be checked")
    if read_bytes(carried, "tokenizer") == read_bytes(data, "tokenizer"):
        return None  # a copy (a checkpoint's is its data's): nothing to parse
    theirs, ours = tokenizer_fingerprint(carried), tokenizer_fingerprint(data)
    if theirs == ours:
        return None
    said = (f"{carried} (tokenizer {short(theirs)}) is another tokenizer than the data's, {data} (tokenizer "
            f"{short(ours)})")
    if allow:
        return f"warning: {where}: {said}; going on as {ALLOW_FLAG} says: the same text is other token ids"
    raise ZayaError(f"{where}: {said}: the same text would be other token ids to the model; {fix}")


def check_model_on_data(model_path: str | Path, data_path: str | Path, *, allow: bool) -> str | None:
    """`check_same_tokenizer` for `zaya eval --model M --data D`: the tokenizer the model M carries (a run's newest
    valid checkpoint's) against the dataset D's."""
    from zaya.data.dataset_reader import open_dataset
    from zaya.weights import resolve_model_dir

    data = open_dataset(data_path).tokenizer_path
    directory, _ = resolve_model_dir(model_path)
    return check_same_tokenizer("--data", directory, find_tokenizer(directory), data, allow=allow,
                                fix=f"evaluate on data built with --tokenizer {model_path}, or pass {ALLOW_FLAG}")
