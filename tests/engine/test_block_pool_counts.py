"""The pool's count of free blocks that still cache a prefix (engine stats read it for every
call the manager places) is kept as blocks move; it always equals a recount of the free
list, under random allocation, sharing, release, publishing and cache hits."""

from __future__ import annotations

import random

import pytest

from parrot_backend.engine.block_pool import BlockPool, root_hash


def _recount(pool: BlockPool) -> int:
    return sum(1 for b in pool.free if pool.block_hash[b] is not None)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_cached_free_count_matches_a_recount(seed, prefix_cache):
    rng = random.Random(seed)
    pool = BlockPool(24, 4, prefix_cache=prefix_cache)
    held: list[int] = []  # one entry per reference we hold
    parent = root_hash(None)
    texts = [tuple(rng.randrange(5) for _ in range(4)) for _ in range(40)]
    cached_seen = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and pool.num_free:
            held.append(pool.allocate())
        elif op < 0.45 and held:
            held.append(held[rng.randrange(len(held))])  # share a held block
            pool.incref(held[-1])
        elif op < 0.7 and held:
            pool.decref(held.pop(rng.randrange(len(held))))
        elif op < 0.85 and held:
            pool.register(held[rng.randrange(len(held))], parent, rng.choice(texts))
        else:
            block = pool.lookup(parent, rng.choice(texts))  # a hit revives a free block
            if block is not None:
                held.append(block)
        assert pool.num_cached_free == _recount(pool)
        cached_seen = max(cached_seen, pool.num_cached_free)
    assert (cached_seen > 0) == prefix_cache  # the sequence did exercise cached free blocks
    for block in held:
        pool.decref(block)
    assert pool.num_free == pool.num_blocks
    assert pool.num_cached_free == _recount(pool)
