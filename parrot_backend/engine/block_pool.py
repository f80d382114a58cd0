"""Refcounted KV blocks with a token-level prefix cache.

A block is `block_size` token slots in every layer's K and V cache. Blocks are shared by
refcount: forked contexts hold their parent's blocks, and requests with equal token
prefixes hold the same cached blocks. A full block may carry a hash that chains all tokens
before it (plus a salt); when its refcount drops to zero it stays in the free list with its
hash, so a later request with the same prefix revives it. Allocation takes the least
recently freed block, which evicts its hash (LRU).
"""

from __future__ import annotations

from collections import OrderedDict


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
        # free blocks that still cache a prefix, kept as blocks move (engine stats read it
        # for every call the manager places: counting the free list was O(pool), ~4 ms a
        # call with a pool of a large memory)
        self._cached_free = 0
        self.hits = 0  # tokens served from the cache
        self.queries = 0  # tokens looked up

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

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if block in self.free:
                self._cached_free -= 1
            if self.by_hash.get(h) == block:
                del self.by_hash[h]
            self.block_hash[block] = None
            self.block_key[block] = None
