"""Prefix analysis: where shareable prefixes end, their keys, and where filled ones live.

A call's tokens and the tokens of its prefixes come from `render.py` (the prompt is
tokenized as one text; a prefix is the part of it that every call with the same text up
to a boundary has). Equal prefixes get equal keys whatever template they come from.

Prefixes considered (boundaries, as segment counts, before the call's first output):

- the **static prefix**: the constant text before the first variable (a system prompt
  shared by every run of a program);
- a **dynamic prefix** after each input variable: text up to a value known only at run
  time (one agent's output read by many others);
- the whole prompt before the first output, where the call's own generation forks off.

A key hashes the model name, a salt and the tokens (`prefix_key`). The salt is None only
for prefixes of public programs; otherwise the server derives it from the tenant, so one
tenant's cache hits (observable by timing) never reveal another tenant's prompts.

`PrefixTable` is the bookkeeping of filled prefixes: which engine context holds each key,
who is using it, and which idle ones to evict first.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from parrot_backend.program import InputRef, OutputRef, Segment, Text

from .identity_cache import IdentityCache

_VERSION = b"parrot-prefix/1\0"  # bump when the key layout changes: old keys must not match


def prefix_boundaries(segments: Sequence[Segment]) -> list[int]:
    """Segment counts where a shareable prefix ends, increasing.

    After the leading text, after each input before the first output, and at the first
    output (the whole prompt). A template with no output has no generation to share for,
    so its boundaries stop at its last input.
    """
    first_output = next((i for i, s in enumerate(segments) if isinstance(s, OutputRef)), None)
    end = len(segments) if first_output is None else first_output
    cuts: list[int] = []
    if end and isinstance(segments[0], Text) and end > 1:
        cuts.append(1)
    cuts.extend(i + 1 for i in range(end) if isinstance(segments[i], InputRef))
    if first_output is not None and end:
        cuts.append(end)
    return sorted(set(cuts))


# Calls of one workflow share their segments tuple (the manager parses a template once):
# its boundaries are computed once per tuple. Hashers are cached after the model and salt.
_CACHE_SIZE = 4096
_CUTS: IdentityCache[tuple[Segment, ...], list[int]] = IdentityCache(prefix_boundaries)
_BASES: dict[tuple[str, str | bytes | None], hashlib.blake2b] = {}


def _boundaries(segments: Sequence[Segment]) -> list[int]:
    """`prefix_boundaries(segments)`, cached for tuples (do not mutate the result)."""
    if type(segments) is not tuple:
        return prefix_boundaries(segments)
    return _CUTS(segments)


def _hasher(model: str, salt: str | bytes | None) -> hashlib.blake2b:
    h = hashlib.blake2b(_VERSION, digest_size=32)
    name = model.encode()
    h.update(struct.pack("<Q", len(name)) + name)
    if salt is None:
        h.update(b"\0")
    else:
        raw = salt.encode() if isinstance(salt, str) else salt
        # length-prefixed so that (salt, tokens) pairs can never run into each other
        h.update(b"\1" + struct.pack("<Q", len(raw)) + raw)
    return h


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None


def prefix_key(model: str, token_ids: Sequence[int], salt: str | bytes | None) -> str:
    """Stable key (hex blake2b-256) of a token prefix of `model` under `salt`.

    `salt` is None for public prefixes, shared across tenants; otherwise a server-derived
    tenant salt. Stable across processes and releases of Python (no `hash()`).
    """
    h = _hasher(model, salt)
    h.update(_pack(token_ids))
    return h.hexdigest()


class Prefix(NamedTuple):
    """A shareable prefix of one call: its key and where it ends.

    A named tuple (immutable and hashable, as a frozen dataclass) because ready calls hold
    a few each: once the collector has seen one it stops tracking it (its fields are a
    string and ints), so the prefixes of calls waiting in memory are not walked again.
    """

    key: str
    n_segments: int
    n_tokens: int


def _base(model: str, salt: str | bytes | None) -> hashlib.blake2b:
    base = _BASES.get((model, salt))
    if base is None:
        if len(_BASES) >= _CACHE_SIZE:
            _BASES.clear()
        base = _BASES[(model, salt)] = _hasher(model, salt)
    return base


@dataclass(slots=True)
class PrefixEntry:
    """A filled prefix: the engine context that holds it and who is using it.

    `refcount` counts running calls forked from it plus child prefixes forked from it (a
    child pins its parent). `own_tokens` are the tokens beyond the parent's: what freeing
    this context gives back (the parent's blocks stay shared).
    """

    key: str
    engine_id: str
    context_id: str
    n_tokens: int
    own_tokens: int
    parent: str | None
    refcount: int = 0
    last_used: float = 0.0


class PrefixTable:
    """Filled prefixes by key. Pure bookkeeping: the caller fills and frees the contexts.

    Entries whose refcount drops to 0 stay ("hot prefixes outlive a run") until `evict`
    picks them, least recently used first, when an engine needs memory.
    """

    def __init__(self) -> None:
        self._entries: dict[str, PrefixEntry] = {}
        self._by_engine: dict[str, set[str]] = {}
        self._idle: Counter[str] = Counter()  # engine id -> its entries with refcount 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> PrefixEntry | None:
        """The entry for `key`, or None."""
        return self._entries.get(key)

    def has_idle(self, engine_id: str) -> bool:
        """Whether `engine_id` holds an entry with refcount 0: without one, `evict` on it
        drops nothing (parents are dropped only after an idle child)."""
        return self._idle[engine_id] > 0

    def held(self, engine_id: str) -> frozenset[str]:
        """Keys of the prefixes filled on `engine_id`."""
        return frozenset(self._by_engine.get(engine_id, ()))

    def longest(self, prefixes: Sequence[Prefix]) -> tuple[Prefix, PrefixEntry] | None:
        """The longest of a call's `prefixes` (shortest first) already filled somewhere."""
        for prefix in reversed(prefixes):
            entry = self._entries.get(prefix.key)
            if entry is not None:
                return prefix, entry
        return None

    def insert(
        self,
        key: str,
        engine_id: str,
        context_id: str,
        n_tokens: int,
        now: float,
        parent: str | None = None,
    ) -> PrefixEntry:
        """Record a filled prefix (refcount 0). `parent` is the key it was forked from,
        which must be on the same engine; the child pins it."""
        if key in self._entries:
            raise ValueError(f"prefix {key} is already filled")
        own = n_tokens
        if parent is not None:
            up = self._entries[parent]
            if up.engine_id != engine_id:
                raise ValueError(f"parent prefix {parent} lives on engine {up.engine_id}")
            if up.refcount == 0:
                self._idle[engine_id] -= 1
            up.refcount += 1
            own = n_tokens - up.n_tokens
        entry = PrefixEntry(key, engine_id, context_id, n_tokens, own, parent, 0, now)
        self._entries[key] = entry
        self._by_engine.setdefault(engine_id, set()).add(key)
        self._idle[engine_id] += 1
        return entry

    def acquire(self, key: str, now: float) -> PrefixEntry:
        """A call starts using the prefix: it cannot be evicted until released."""
        entry = self._entries[key]
        if entry.refcount == 0:
            self._idle[entry.engine_id] -= 1
        entry.refcount += 1
        entry.last_used = now
        return entry

    def release(self, key: str, now: float) -> None:
        """A call stopped using the prefix; at refcount 0 it stays, evictable."""
        entry = self._entries[key]
        if entry.refcount <= 0:
            raise ValueError(f"prefix {key} released more often than acquired")
        entry.refcount -= 1
        entry.last_used = now
        if entry.refcount == 0:
            self._idle[entry.engine_id] += 1

    def evictable_tokens(self, engine_id: str) -> int:
        """Tokens `evict` could free on `engine_id` now: idle entries, and parents pinned
        only by idle children."""
        keys = self._by_engine.get(engine_id, set())
        children = Counter(p for k in keys if (p := self._entries[k].parent) is not None)
        blocked: set[str] = set()
        for k in keys:
            if self._entries[k].refcount > children[k]:  # a running call uses it
                node: str | None = k
                while node is not None and node not in blocked:
                    blocked.add(node)
                    node = self._entries[node].parent
        return sum(self._entries[k].own_tokens for k in keys if k not in blocked)

    def evict(self, engine_id: str, n_tokens: int) -> list[PrefixEntry]:
        """Drop idle prefixes on `engine_id`, least recently used first, until at least
        `n_tokens` are freed or nothing idle is left.

        Returns the dropped entries, children before their parents: the caller frees
        their contexts in that order.
        """
        keys = self._by_engine.get(engine_id, set())
        heap = [(e.last_used, k) for k in keys if (e := self._entries[k]).refcount == 0]
        heapq.heapify(heap)
        dropped: list[PrefixEntry] = []
        freed = 0
        while heap and freed < n_tokens:
            _, key = heapq.heappop(heap)
            entry = self._remove(key)
            dropped.append(entry)
            freed += entry.own_tokens
            if entry.parent is not None:
                up = self._entries[entry.parent]
                up.refcount -= 1
                if up.refcount == 0:
                    self._idle[engine_id] += 1
                    heapq.heappush(heap, (up.last_used, up.key))
        return dropped

    def drop_engine(self, engine_id: str) -> list[PrefixEntry]:
        """Forget every prefix of an engine that went away."""
        keys = self._by_engine.pop(engine_id, set())
        self._idle.pop(engine_id, None)
        return [self._entries.pop(k) for k in sorted(keys)]

    def _remove(self, key: str) -> PrefixEntry:
        entry = self._entries.pop(key)
        self._by_engine[entry.engine_id].discard(key)
        if entry.refcount == 0:
            self._idle[entry.engine_id] -= 1
        return entry
