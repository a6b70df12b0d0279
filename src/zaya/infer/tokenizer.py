"""Finding and loading a `tokenizer.json` (Hugging Face `tokenizers` format) for a model directory."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from zaya.errors import ZayaError

TOKENIZER_FILE = "tokenizer.json"


def find_tokenizer(model_dir: Path) -> Path | None:
    """The tokenizer.json inside `model_dir`, if there is one."""
    candidate = Path(model_dir) / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a tokenizer.json, turning a missing or corrupt file into one clear error."""
    path = Path(path)
    if not path.is_file():
        raise ZayaError(f"{path}: file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception subclass for bad files
        raise ZayaError(f"{path}: not a valid tokenizer.json ({str(exc).splitlines()[0]})") from None
