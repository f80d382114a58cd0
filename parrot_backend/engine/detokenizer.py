"""Incremental detokenization with stop strings.

Text deltas never split a multi-byte UTF-8 character (a token that ends mid-character
yields nothing until the character completes) and never include text past a stop string:
text that could be the start of a stop string is held back until it is resolved.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns one generation's token ids into text deltas."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already handed out
        self.text = ""  # complete text so far (no trailing partial character)
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text that can be released now."""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        # a trailing replacement char means the last token ended inside a character
        while text.endswith(REPLACEMENT):
            text = text[:-1]
        self.text = text
        first = None
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and (first is None or at < first):
                first = at
        if first is not None:
            self.text = text[:first]
            self.stopped = True
            return self._release(first)
        return self._release(len(text) - self._held(text))

    def flush(self) -> str:
        """At the end of a generation: release whatever is still held back."""
        return self._release(len(self.text))

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that could begin a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
