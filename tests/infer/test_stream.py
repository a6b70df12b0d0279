"""Streamed text (`zaya.infer.stream`): what is shown token by token adds up to the whole continuation's text,
multi-byte characters spread over tokens included, and each token is decoded with a bounded window, never the
whole continuation (which made a long output quadratic)."""

from __future__ import annotations

from zaya.data.tokenizer import load_tokenizer
from zaya.infer.stream import TextStream


class _Counting:
    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids)


def test_streamed_pieces_add_up_to_the_text_in_bounded_windows(dataset):
    tokenizer = load_tokenizer(dataset / "tokenizer.json")
    text = "def héllo(wörld):\n    return '✓ 日本語 🙂' * 3  # ünïcödé\n" * 40
    ids = tokenizer.encode(text).ids
    counting = _Counting(tokenizer)
    stream = TextStream(counting, pending_limit=16)
    shown = "".join(stream.push(i) for i in ids) + stream.rest()
    assert shown == tokenizer.decode(ids)
    assert len(ids) > 500 and counting.longest <= 2 * 16 + 2
