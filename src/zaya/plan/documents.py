"""The attention work of a phase that keeps packed documents apart (`isolate_documents`), as the planner counts it.

A query sees only the keys of its own document (`zaya.model.masks`), so a row of T tokens that holds documents of
lengths l_1, l_2, ... costs sum_i l_i (l_i + 1) / 2 query-key pairs instead of causal attention's T (T + 1) / 2.
The planner knows one number about the documents, their mean length m, and assumes every document that long:
a row then holds T / m documents and costs

    pairs(T, m) = T (min(m, T) + 1) / 2          (m = T, or longer: causal attention over the whole row)

A mix of lengths with the same mean costs more: sum_i l_i^2 / 2 = (T / m)(m^2 + var) / 2, i.e. (1 + cv^2) times
as much (cv: the lengths' standard deviation over their mean; exponential lengths, cv = 1, twice as much). To plan
such a mix, give the length weighted by length, E[l^2] / E[l], as the mean. A kernel works in blocks of queries
and keys, so documents shorter than `MIN_BLOCK` tokens are counted as that long.

The mean comes from the phase's `document_tokens`, or else from its datasets' manifests: each source's
num_tokens / num_documents of its train split, mixed by the sources' weights (a source's share of the tokens;
documents per token add up, so the mixture's mean is the weighted harmonic mean); a source without a manifest
(a plan made away from the data) counts as documents of the whole row.

A sliding block of window W (`hybrid_sliding`) sees at most W keys per query. Its kernel runs a row (or a
document) longer than W as tiles of t queries (`zaya.model.masks`: t = W clamped to 64 ... 512) each over the
t + W - 1 keys its window reaches, and computes each tile's rectangle whole (the mask only hides the pairs), so
its work is sum over tiles of t (t + W - 1), about T (W + t - 1) against the T W - W (W - 1) / 2 pairs the mask
allows (`window_work`: 12% more at W = 4096, t = 512). A row or document of at most W tokens is plain causal
attention, as in a `hybrid` block. Timing counts the kernel's work; the FLOPs of MFU count the allowed pairs
(`zaya.model.flops`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from zaya.data.dataset_reader import read_manifest
from zaya.data.shards import MANIFEST_FILE
from zaya.model.masks import DocumentLayout, segment_work
from zaya.train.config import Phase

MIN_BLOCK = 128  # a fused kernel's block of queries and keys; shorter documents cost about a block each


@dataclass(frozen=True)
class DocumentPlan:
    """What the planner assumes of a phase's packed documents: their mean length in tokens, and where it came
    from (for the plan's text)."""

    tokens: int
    source: str  # "phases.N.document_tokens", "the datasets' manifests", or "the whole row"

    def to_dict(self) -> dict:
        return {"document_tokens": self.tokens, "from": self.source}


def causal_pairs(seq_len: int, window: int | None = None) -> float:
    """Query-key pairs a kernel computes for causal attention over a row of `seq_len` tokens: every pair of the
    causal square, or with a sliding `window` the tiles of its band (`window_work`)."""
    return float(window_work(seq_len, window))


def document_pairs(seq_len: int, document_tokens: int, window: int | None = None) -> float:
    """Query-key pairs of a row of `seq_len` tokens holding documents of `document_tokens` tokens each (see the
    module docstring), each document's under a sliding `window` if there is one."""
    length = min(max(document_tokens, MIN_BLOCK), seq_len)
    return seq_len * window_work(length, window) / length


@functools.lru_cache(maxsize=256)
def window_work(length: int, window: int | None) -> int:
    """The pairs a kernel computes for one causal row of `length` tokens within `window` (None: none): the
    causal square's, or beyond the window the tiles' rectangles the kernel plan runs (`zaya.model.masks`)."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return segment_work(DocumentLayout(((0,),), length, window).segments(), 1)


def attention_length(seq_len: int, documents: DocumentPlan | None, window: int | None = None) -> int:
    """The length of the attention a kernel runs: the row's, or one document's, or at most the window's (what a
    measured rate is looked up at)."""
    length = seq_len if documents is None else min(max(documents.tokens, MIN_BLOCK), seq_len)
    return length if window is None else min(length, window)


def phase_documents(phase: Phase, index: int, seq_len: int) -> DocumentPlan | None:
    """The `DocumentPlan` of phase `phase` (number `index` of the config), None where it does not keep documents
    apart. A manifest that is there but unreadable is a `ZayaError` naming it."""
    if not phase.isolate_documents:
        return None
    if phase.document_tokens:
        return DocumentPlan(min(phase.document_tokens, seq_len), f"phases.{index}.document_tokens")
    total = sum(source.weight for source in phase.sources)
    per_token, found = 0.0, 0
    for source in phase.sources:
        mean = _manifest_mean(Path(source.path))
        found += mean is not None
        per_token += source.weight / total / min(mean or seq_len, seq_len)
    if not found:
        return DocumentPlan(seq_len, "the whole row (no dataset manifest found)")
    return DocumentPlan(max(1, round(1 / per_token)), "the datasets' manifests")


def _manifest_mean(path: Path) -> float | None:
    """Tokens per document of the train split of the dataset at `path`; None where there is no manifest."""
    try:
        stat = os.stat(path / MANIFEST_FILE)
    except OSError:
        if os.path.lexists(path / MANIFEST_FILE):  # there, but unusable: the read says why
            return _read_mean(str(path), 0, 0)
        return None
    return _read_mean(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_mean(path: str, mtime_ns: int, size: int) -> float | None:
    """`_manifest_mean` of a manifest as it is at (`mtime_ns`, `size`): a layout search plans every phase
    thousands of times."""
    _, splits = read_manifest(Path(path))
    train = splits["train"]
    return train.num_tokens / train.num_documents if train.num_documents else None
