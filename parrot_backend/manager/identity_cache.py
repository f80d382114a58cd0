"""`IdentityCache`: a value computed once per shared, read-only object, keyed by identity.

The manager shares some objects across runs and calls (a workflow's segments tuple, an
output's `GenerationConfig`) and derives values from them on every call. Hashing them
would cost as much as deriving; their identity is free. An entry holds its key object, so
the key's `id()` is not reused while the entry lives. The keys must never change: they
are frozen (`GenerationConfig`) or immutable (tuples). When the cache is full it starts
over (the working set is a few hundred objects; the bound only stops a leak).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityCache(Generic[K, V]):
    """`cache(key)` is `compute(key)`, computed once per key object (by identity)."""

    __slots__ = ("_compute", "_entries", "_size")

    def __init__(self, compute: Callable[[K], V], size: int = 4096) -> None:
        self._compute = compute
        self._size = size
        self._entries: dict[int, tuple[K, V]] = {}

    def __call__(self, key: K) -> V:
        hit = self._entries.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        value = self._compute(key)
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[id(key)] = (key, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
