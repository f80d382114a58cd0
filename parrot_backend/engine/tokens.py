"""The one tokenization convention of every engine (in-process or remote).

Text is tokenized without added special tokens (no BOS). Template text may spell special
tokens (`<|im_start|>` in a chat template) and gets their ids; data (`data=True`: values
substituted into templates) never does: a value holding `<|im_end|>` stays those
characters, so a value cannot close a chat role. Decoding drops special tokens (EOS never
shows up in text).
"""

from __future__ import annotations

from typing import Any


def encode_segment(tokenizer: Any, text: str, *, data: bool = False) -> list[int]:
    """Token ids of one text segment; `data`: special-token spellings stay plain text."""
    if data:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return tokenizer.encode(text, add_special_tokens=False)


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens by spelling (what template text may contain)."""
    ids = getattr(tokenizer, "all_special_ids", None) or []
    names = getattr(tokenizer, "all_special_tokens", None) or []
    return {name: i for name, i in zip(names, ids, strict=False) if isinstance(name, str)}


def decode_tokens(tokenizer: Any, token_ids: list[int]) -> str:
    """Text of generated token ids."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)
