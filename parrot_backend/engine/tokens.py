"""The one tokenization convention of every engine (in-process or remote).

Segments are tokenized alone and without special tokens, so a call's tokens are the
concatenation of its segments' tokens in every path and shared prefixes match; decoding
drops special tokens (EOS never shows up in text).
"""

from __future__ import annotations

from typing import Any


def encode_segment(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one text segment."""
    return tokenizer.encode(text, add_special_tokens=False)


def decode_tokens(tokenizer: Any, token_ids: list[int]) -> str:
    """Text of generated token ids."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)
