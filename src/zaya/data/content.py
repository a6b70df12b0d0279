"""What a split holds, as hashes that join: the same for a dataset built in one go and for one merged from parts.

A dataset's fingerprint hashes its manifest, which lists its shard files: two datasets of the same token stream
cut into other shards (a one-machine build, and the same inputs built in parts and merged) have two
fingerprints. What they hold is compared by a hash of the stream itself that can be computed part by part and
joined without reading the parts again: a polynomial hash,

    H(x_0 .. x_{n-1}) = sum_i x_i r^(n-1-i)  mod 2^64,     H(A B) = H(A) r^|B| + H(B)  mod 2^64,

twice (two odd bases: 128 bits), over the tokens, over the documents' lengths, and over a chat dataset's loss
mask. Each is a `Stream`: the two hashes and the length. It identifies content for the sample order and for
comparisons; it is not a cryptographic hash and does not defend against a crafted collision (the files'
SHA-256 in the manifest do that). Arithmetic modulo 2^64 is numpy's own wrapping uint64 arithmetic: about 5 ns
a token with the powers of the bases computed once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

BASES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_MOD = 1 << 64
_BLOCK = 1 << 16  # values hashed at once, against one table of powers of each base (512 KiB)


@dataclass(frozen=True)
class Stream:
    """The hashes of a sequence (one per base) and its length."""

    hashes: tuple[int, int] = (0, 0)
    length: int = 0

    def extend(self, values: np.ndarray) -> Stream:
        """This sequence followed by `values` (non-negative integers)."""
        return self.join(of(values))

    def join(self, other: Stream) -> Stream:
        """This sequence followed by `other`."""
        hashes = tuple((h * pow(r, other.length, _MOD) + g) % _MOD
                       for h, g, r in zip(self.hashes, other.hashes, BASES, strict=True))
        return Stream(hashes, self.length + other.length)

    def text(self) -> str:
        return f"{self.hashes[0]:016x}{self.hashes[1]:016x}:{self.length}"

    @classmethod
    def parse(cls, text: str) -> Stream:
        digits, _, length = text.partition(":")
        if len(digits) != 32 or not length.isdigit():
            raise ValueError(f"not a content hash: {text!r}")
        return cls((int(digits[:16], 16), int(digits[16:], 16)), int(length))


def of(values: np.ndarray) -> Stream:
    """The `Stream` of a sequence of non-negative integers, a block of `_BLOCK` at a time."""
    x = np.asarray(values).reshape(-1).astype(np.uint64, copy=False)
    stream = Stream()
    for start in range(0, len(x), _BLOCK):
        block = x[start:start + _BLOCK]
        n = len(block)
        with np.errstate(over="ignore"):
            hashes = tuple(int((block * _powers(r)[_BLOCK - n:]).sum(dtype=np.uint64)) for r in BASES)
        stream = stream.join(Stream(hashes, n))
    return stream


@functools.cache
def _powers(r: int) -> np.ndarray:
    """r^(BLOCK-1) .. r^1, r^0 modulo 2^64: the weights of a block's values, the last one's 1."""
    powers = np.ones(1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        while len(powers) < _BLOCK:
            powers = np.concatenate([powers, powers * np.uint64(pow(r, len(powers), _MOD))])
    return np.ascontiguousarray(powers[:_BLOCK][::-1])
