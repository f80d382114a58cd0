"""Refcounted KV blocks with a token-level prefix cache.

A block is `block_size` token slots in every layer's K and V cache. Blocks are shared by
refcount: forked contexts hold their parent's blocks, and requests with equal token
prefixes hold the same cached blocks. A full block may carry a hash that chains all tokens
before it (plus a salt); when its refcount drops to zero it stays in the free list with its
hash, so a later request with the same prefix revives it. Allocation takes the least
recently freed block, which evicts its hash (LRU).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

# a prompt-scoring fill's entry for one token: (its logprob, the top k as (id, logprob))
Entry = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class BlockScores:
    """The log probabilities a scoring fill computed for one cached block's tokens (each
    given every token before it), from token `first` of the block on (those before were
    not the fill's): token i's own in `chosen[i]`, its top `k` alternatives in
    `ids`/`values[i * k : (i + 1) * k]`. float32, as the engine computes them (so exact);
    a token without an entry reads NaN. About 700 bytes a block at k = 5."""

    k: int
    first: int
    chosen: array
    ids: array
    values: array

    @classmethod
    def pack(cls, k: int, first: int, entries: list[Entry | None]) -> BlockScores:
        chosen, ids, values = array("f"), array("i"), array("f")
        for entry in entries:
            if entry is None:  # not the fill's token, or the chain's first
                chosen.append(float("nan"))
                ids.extend([0] * k)
                values.extend([0.0] * k)
                continue
            chosen.append(entry[0])
            ids.extend(i for i, _ in entry[1])
            values.extend(v for _, v in entry[1])
        return cls(k, first, chosen, ids, values)

    def entry(self, i: int, k: int) -> Entry:
        """Token i's entry with its top `k` (at most this block's)."""
        at = i * self.k
        top = list(zip(self.ids[at : at + k], self.values[at : at + k], strict=True))
        return self.chosen[i], top


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of everything before it."""
    return hash((parent, tokens))


def root_hash(salt: str | None) -> int:
    """The chain's start: a salt keeps one tenant's cached prefixes from matching another's."""
    return hash(("parrot-root", salt))


class BlockPool:
    """Free list, refcounts and the hash index of cached full blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks  # (parent, tokens) to verify
        self.by_hash: dict[int, int] = {}
        # a scoring fill's log probabilities of a cached block's tokens, by its chain hash,
        # while some block caches that hash: a later scoring fill of the same prefix takes
        # them with the KV instead of computing the block again (a multiple-choice task
        # scores one context with each of its answers)
        self.scores: dict[int, BlockScores] = {}
        # free blocks that still cache a prefix, kept as blocks move (engine stats read it
        # for every call the manager places: counting the free list was O(pool), ~4 ms a
        # call with a pool of a large memory)
        self._cached_free = 0
        self.hits = 0  # tokens served from the cache
        self.queries = 0  # tokens looked up
        self.scores_reused = 0  # token scores taken from kept scores (the scheduler counts)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        return self._cached_free

    def allocate(self) -> int:
        """Take the least recently freed block (dropping any prefix it cached)."""
        if not self.free:
            raise MemoryError("no free KV blocks")
        block, _ = self.free.popitem(last=False)
        if self.block_hash[block] is not None:
            self._cached_free -= 1
        self._forget(block)
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
            if self.block_hash[block] is not None:
                self._cached_free -= 1
        self.ref[block] += 1

    def decref(self, block: int) -> None:
        self.ref[block] -= 1
        assert self.ref[block] >= 0, f"block {block} released twice"
        if self.ref[block] == 0:
            self.free[block] = None  # most recently freed goes last
            if self.block_hash[block] is not None:
                self._cached_free += 1

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        """A cached block holding exactly these tokens after this parent hash (incref'd)."""
        if not self.prefix_cache:
            return None
        self.queries += len(tokens)
        block = self.by_hash.get(chain_hash(parent, tokens))
        if block is None or self.block_key[block] != (parent, tokens):
            return None
        self.hits += len(tokens)
        self.incref(block)
        return block

    def register(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Publish a just-completed full block; returns its hash for chaining."""
        h = chain_hash(parent, tokens)
        if self.prefix_cache and self.block_hash[block] is None and h not in self.by_hash:
            self.block_hash[block] = h
            self.block_key[block] = (parent, tokens)
            self.by_hash[h] = block
            if block in self.free:
                self._cached_free += 1
        return h

    def keep_scores(self, h: int, k: int, first: int, entries: list[Entry | None]) -> None:
        """Keep a cached block's token scores (`h`: its chain hash, as `register` returns;
        `entries` from token `first` of the block on), unless that hash is not cached or
        already has scores with a top k as large from a token as early."""
        kept = self.scores.get(h)
        if h in self.by_hash and (kept is None or kept.k < k or kept.first > first):
            if kept is None or (kept.k <= k and kept.first >= first):
                self.scores[h] = BlockScores.pack(k, first, entries)

    def cached_scores(self, h: int, k: int, first: int = 0) -> BlockScores | None:
        """The kept scores of the cached block with chain hash `h`, if they have a top k
        of at least `k` and entries from its token `first` on."""
        kept = self.scores.get(h)
        return kept if kept is not None and kept.k >= k and kept.first <= first else None

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if block in self.free:
                self._cached_free -= 1
            if self.by_hash.get(h) == block:
                del self.by_hash[h]
                self.scores.pop(h, None)
            self.block_hash[block] = None
            self.block_key[block] = None
