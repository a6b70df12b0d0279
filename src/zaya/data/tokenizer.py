"""The tokenizer of a dataset: a byte-level BPE trained on the corpus, or a given `tokenizer.json`.

A trained tokenizer reserves its first ids for the special tokens `<pad>`=0, `<eos>`=1 and `<bos>`=2, the
model config's defaults, so a model built from a preset needs no id remapping. The builder appends the
end-of-document token after every document; the tokenizer itself adds nothing, so encoding a prompt at
inference gives just the prompt's ids. A BPE trained for a chat dataset also reserves its chat template's
markers (`<|im_start|>`, `<|im_end|>`), after those three; a text dataset reserves them when asked
(`--reserve-chat-markers`), so that one tokenizer serves pre-training and the chats after it, and so do any
other special tokens asked for (`--special-token`).

What a tokenizer is, for the checks that a model and its data share one (`train.init_from`, a resume, `zaya eval
--data`), is its content: `content_fingerprint` hashes the parsed tokenizer (its model, added tokens, normalizer,
pre-tokenizer, decoder and post-processor) as `tokenizers` writes it back, so the same tokenizer saved pretty or
compact, with its keys or merges written another way, is the same tokenizer; the bytes' own sha256 stays the
dataset manifest's record of its file.

Training is deterministic: the `tokenizers` BPE trainer has no randomness, assigns the 256 byte-level symbols
ids in sorted order and breaks ties between equally frequent pairs by those ids. (Its one known source of run-
to-run differences, lazily created continuing-subword tokens, is unused by byte-level BPE.) The dataset tests
check that two builds, in two processes, produce the same tokenizer bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zaya.errors import ZayaError
from zaya.reading import decode_text, read_bytes

TOKENIZER_FILE = "tokenizer.json"  # in a dataset, a checkpoint and an HF directory alike
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside it, where the tokenizer has a chat template (transformers' name)
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
DEFAULT_VOCAB_SIZE = 8192
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
# 256 byte symbols plus the special tokens: anything smaller cannot encode every string
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 32
# bounds on the special tokens a build may be asked to reserve: each is one entry of the vocabulary
MAX_SPECIAL_TOKENS = 1024
MAX_SPECIAL_TOKEN_CHARS = 256
# what a tokenizer does, in tokenizer.json's own keys (its truncation, padding and version are settings of use)
_CONTENT_KEYS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "decoder", "post_processor")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the dataset records about its tokenizer."""

    vocab_size: int
    eos_id: int
    special_ids: dict[str, int]
    sha256: str

    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "eos_id": self.eos_id, "special_ids": dict(self.special_ids),
                "sha256": self.sha256}


def find_tokenizer(directory: Path) -> Path | None:
    """The tokenizer.json inside `directory` (a model, checkpoint or dataset directory), if there is one."""
    candidate = Path(directory) / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a tokenizer.json, turning a missing or corrupt file into one clear error."""
    return open_tokenizer(path)[0]


def open_tokenizer(path: Path) -> tuple[Tokenizer, bytes]:
    """A tokenizer.json and its exact bytes (the dataset stores an identical copy): a regular file of at most
    256 MiB (the largest vocabularies in use take about 30 MB), UTF-8, that `tokenizers` can read."""
    path = Path(path)
    data = read_bytes(path, "tokenizer", "a tokenizer.json")
    text = decode_text(data, path)
    try:
        return Tokenizer.from_str(text), data
    except Exception as exc:  # tokenizers raises a plain Exception subclass for bad files
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ZayaError(f"{path}: not a valid tokenizer.json ({first[:200]})") from None


def check_vocab_size(vocab_size: int) -> None:
    """Refuse a vocabulary size a byte-level BPE cannot have."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ZayaError(f"--vocab-size must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE}, got {vocab_size}")


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, progress: bool = False,
              extra_special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A byte-level BPE with `vocab_size` entries (fewer if the corpus has too few distinct pairs), whose special
    tokens are SPECIAL_TOKENS and then `extra_special_tokens`. The trainer does not cut the texts at special
    tokens: texts given to it must not contain them."""
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *(t for t in extra_special_tokens if t not in SPECIAL_TOKENS)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_bytes(tokenizer: Tokenizer) -> bytes:
    """The tokenizer.json bytes of a tokenizer made here."""
    return tokenizer.to_str(pretty=True).encode("utf-8")


def describe(tokenizer: Tokenizer, data: bytes, source: str, eos_token: str = EOS_TOKEN,
             markers: Sequence[str] = ()) -> TokenizerInfo:
    """The dataset's record of a tokenizer; `data` is its JSON as stored, `source` names it in errors, `markers`
    are a chat template's (whose ids are recorded too)."""
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ZayaError(f"{source}: no '{eos_token}' token; name the end-of-document token with --eos-token")
    special_ids = {token: tokenizer.token_to_id(token) for token in (*SPECIAL_TOKENS, eos_token, *markers)}
    return TokenizerInfo(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_id=eos_id,
        special_ids={token: i for token, i in special_ids.items() if i is not None},
        sha256=hashlib.sha256(data).hexdigest(),
    )


def added_tokens(tokenizer: Tokenizer) -> list[str]:
    """The texts of a tokenizer's added (special and other) tokens, in id order."""
    return [token.content for _, token in sorted(tokenizer.get_added_tokens_decoder().items())]


def is_single_token(tokenizer: Tokenizer, text: str) -> bool:
    """Whether `text` encodes as exactly one token of `tokenizer`, its own."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return len(ids) == 1 and tokenizer.token_to_id(text) == ids[0]


def check_markers(tokenizer: Tokenizer, markers: Sequence[str], source: str) -> None:
    """Refuse a tokenizer that would cut one of a chat template's markers into pieces."""
    for marker in markers:
        if not is_single_token(tokenizer, marker):
            raise ZayaError(f"{source}: the chat template's marker {marker!r} is not a token of this tokenizer; "
                            "give a tokenizer that has it as a special token (a text build with "
                            "--reserve-chat-markers reserves them), or a --chat-template whose markers it has")


def check_special_tokens(tokens: Sequence[str]) -> None:
    """Refuse special tokens that cannot be one entry of a vocabulary: empty, only whitespace, too long, or too
    many of them."""
    if len(tokens) > MAX_SPECIAL_TOKENS:
        raise ZayaError(f"--special-token: at most {MAX_SPECIAL_TOKENS} special tokens, got {len(tokens)}")
    for token in tokens:
        if not token.strip():
            raise ZayaError(f"--special-token: {token!r} is empty or only whitespace; give the token's text, "
                            "e.g. '<|tool|>'")
        if len(token) > MAX_SPECIAL_TOKEN_CHARS:
            raise ZayaError(f"--special-token: {token[:40]!r}... is {len(token):,} characters, more than the "
                            f"{MAX_SPECIAL_TOKEN_CHARS} a special token may have")


def content_fingerprint(tokenizer: Tokenizer) -> str:
    """The hex sha256 of what `tokenizer` does (see the module docstring): equal for two tokenizer.json files
    that differ only in how they are written."""
    data = json.loads(tokenizer.to_str())
    canonical = {key: data.get(key) for key in _CONTENT_KEYS}
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(path: Path) -> str:
    """`content_fingerprint` of the tokenizer.json at `path` (one `ZayaError` if it cannot be read)."""
    return content_fingerprint(load_tokenizer(path))
