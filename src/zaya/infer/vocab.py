"""Which tokenizer a model's text may go through, and which ids it can decode.

A model's vocabulary is often larger than its tokenizer (`tiny` has 8,192 ids, a tokenizer built for a small
dataset fewer): the ids beyond the tokenizer were never in the training data, and a tokenizer decodes an id it
does not have as nothing, without an error. So:

- a tokenizer with an id the model cannot embed (>= its vocabulary) is not this model's, and is refused;
- a tokenizer given in place of the one the model carries (a checkpoint keeps the tokenizer.json its training
  data was built with, an export keeps it too) must reach as high as that one: with a smaller one the model
  would produce ids it learned that the text cannot show;
- text is generated only from the ids the tokenizer has (`allowed_ids`: the others are never sampled, nor
  picked greedily), and the end-of-sequence id, which stops generation and is not shown.

Token ids printed as ids (`zaya generate --output ids`) are the model's own choice, unmasked.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from zaya.data.tokenizer import find_tokenizer, load_tokenizer
from zaya.errors import ZayaError


def tokenizer_ids(tokenizer: Tokenizer) -> list[int]:
    """Every id `tokenizer` has (its vocabulary and added tokens), sorted."""
    return sorted(set(tokenizer.get_vocab(with_added_tokens=True).values()))


def check_tokenizer(tokenizer: Tokenizer, source: Path | str, vocab_size: int,
                    trained_with: tuple[Tokenizer, Path] | None = None) -> list[int]:
    """The ids of `tokenizer` (read from `source`), once it is known to fit a model of `vocab_size` ids and, if
    `trained_with` (the model's own tokenizer and its file) is given, to reach as high as that one. One line
    naming the file otherwise."""
    ids = tokenizer_ids(tokenizer)
    if not ids:
        raise ZayaError(f"{source}: the tokenizer has no tokens")
    if ids[-1] >= vocab_size:
        raise ZayaError(f"{source}: the tokenizer has ids up to {ids[-1]:,}, beyond the model's vocabulary of "
                        f"{vocab_size:,} (ids 0..{vocab_size - 1:,}): it is not this model's tokenizer")
    if trained_with is not None:
        own, own_source = trained_with
        own_top = max(tokenizer_ids(own), default=-1)
        if ids[-1] < own_top:
            raise ZayaError(f"{source}: the tokenizer's ids end at {ids[-1]:,}, below the {own_top:,} of the "
                            f"tokenizer the model was trained with ({own_source}): the model would produce ids "
                            "this one cannot decode")
    return ids


def allowed_ids(ids: list[int], vocab_size: int, eos_token_id: int | None = None) -> torch.Tensor:
    """A mask [vocab_size] (bool) of the ids text may be generated from: `ids` (a tokenizer's) and the
    end-of-sequence id."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[torch.tensor(ids, dtype=torch.long)] = True
    if eos_token_id is not None and 0 <= eos_token_id < vocab_size:
        allowed[eos_token_id] = True
    return allowed


def trained_tokenizer(model_dir: Path, given: Path | None) -> tuple[Tokenizer, Path] | None:
    """The tokenizer the model in `model_dir` carries, when a `given` one is used in its place (None: none is
    given, the model carries none, or it is the given file); one the model carries that cannot be read is no
    record to compare with."""
    own = find_tokenizer(model_dir)
    if given is None or own is None or own.resolve() == Path(given).resolve():
        return None
    try:
        return load_tokenizer(own), own
    except ZayaError:
        return None
