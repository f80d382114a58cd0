"""API keys: random secrets of which only a SHA-256 digest is stored."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "prt_"


def new_key() -> str:
    """A fresh API key (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored digest of a key.

    A plain (unsalted, fast) hash suffices because keys are 256-bit random secrets:
    nothing can be guessed, so slow password hashing would only cost latency per request.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()
