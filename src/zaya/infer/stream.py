"""Generated text as it comes: each new token decoded with the few before it.

A token's text can depend on its neighbours (a leading space, a character of several bytes spread over tokens), so
a token is never decoded alone; decoding the whole continuation at every token instead would make a long output
quadratic. A piece that adds nothing, or ends in an incomplete character, waits for the next token, at most
`pending_limit` of them.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """`push` each token id as it is generated and print what it returns; `rest` once generation has ended."""

    def __init__(self, tokenizer: Any, pending_limit: int = 16):
        self.tokenizer, self.pending_limit = tokenizer, pending_limit
        self.ids: list[int] = []
        self.start = self.seen = 0  # ids[start:seen] decodes to what was last shown of the window

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while it waits for more)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.start:self.seen])
        text = self.tokenizer.decode(self.ids[self.start:])
        waited = len(self.ids) - self.seen > self.pending_limit
        if waited or (len(text) > len(before) and not text.endswith("\ufffd")):
            self.start, self.seen = self.seen, len(self.ids)
            return text[len(before):]
        return ""

    def rest(self) -> str:
        """What is left to show once the last token has come."""
        return self.tokenizer.decode(self.ids[self.start:])[len(self.tokenizer.decode(self.ids[self.start:self.seen])):]
