"""Shared helpers for the data tests: small synthetic corpora, a small trained tokenizer, and datasets whose
tokens are their own positions, so every sample a loader returns tells where it came from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from zaya.data.dataset_writer import DatasetWriter
from zaya.data.shards import token_dtype
from zaya.data.tokenizer import tokenizer_bytes, train_bpe

WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
    "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "def", "return",
    "class", "import", "yield", "async", "await", "ünïcödé", "日本語",
)


def _synthetic_documents(count: int, seed: int = 0, words: int = 60) -> list[str]:
    """Deterministic pseudo-text documents of a few hundred characters each."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        n = int(rng.integers(words // 2, words * 2))
        lines = []
        for chunk in np.array_split(rng.choice(len(WORDS), n), max(1, n // 8)):
            lines.append(" ".join(WORDS[i] for i in chunk))
        docs.append("\n".join(lines) + "\n")
    return docs


def _write_corpus(root: Path, docs: list[str]) -> Path:
    """A directory with the documents spread over .txt files and a .jsonl file."""
    root.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    for i, doc in enumerate(docs[:half]):
        (root / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    with open(root / "rest.jsonl", "w", encoding="utf-8") as handle:
        for doc in docs[half:]:
            handle.write(json.dumps({"text": doc, "id": 1}) + "\n")
    return root


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 320-entry byte-level BPE trained on synthetic text."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_bytes(tokenizer_bytes(train_bpe(_synthetic_documents(50, seed=99), 320)))
    return path


def _write_position_dataset(path: Path, train_tokens: int, val_tokens: int = 0, shard_tokens: int = 1 << 20,
                           vocab_size: int = 1 << 20, tokenizer_json: bytes = b"{}",
                           offset: int = 0) -> Path:
    """A dataset whose token at stream position t is `offset + t`, written with the real writer."""
    path.mkdir(parents=True)
    writer = DatasetWriter(path, token_dtype(vocab_size), shard_tokens)
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        if count:
            tokens = np.arange(offset, offset + count, dtype=np.int64)
            doc_lengths = np.full(count // 100, 100, dtype=np.int64)
            doc_lengths = np.append(doc_lengths, count - doc_lengths.sum())
            writer.write(split, tokens, doc_lengths[doc_lengths > 0])
    tokenizer = {"vocab_size": vocab_size, "eos_id": 1, "special_ids": {"<eos>": 1},
                 "sha256": hashlib.sha256(tokenizer_json).hexdigest()}
    corpus = {"files": 0, "text_bytes": 0, "documents": 0, "bad_records": 0, "invalid_utf8_documents": 0}
    writer.finish(tokenizer_json, tokenizer, corpus)
    return path


@pytest.fixture
def synthetic_documents():
    """`synthetic_documents(count, seed=0, words=60)`: deterministic pseudo-text documents."""
    return _synthetic_documents


@pytest.fixture
def write_corpus():
    """`write_corpus(root, docs)`: the documents as .txt files plus one .jsonl file under `root`."""
    return _write_corpus


@pytest.fixture
def position_dataset(tmp_path):
    """`position_dataset(name, train_tokens, val_tokens=0, ...)`: a dataset under tmp_path whose token at
    stream position t is `offset + t`."""

    def make(name: str, train_tokens: int, val_tokens: int = 0, **kwargs) -> Path:
        return _write_position_dataset(tmp_path / name, train_tokens, val_tokens, **kwargs)

    return make
