"""A scoring fill keeps its blocks' token scores with the prefix cache, and a later scoring
fill of the same prefix takes the KV and the scores of those blocks instead of computing
them (a multiple-choice task scores one context with each answer): its entries equal
transformers' as before, with fewer tokens computed. Checked for the same prompt twice, a
shared context with two continuations, two concurrent fills of one prompt, a prompt that
ends on a block boundary (nothing computed; a generation after it as after any fill), a
larger top k than kept (computed; a smaller one then sliced from the kept), another
tenant's salt, the cache off, a fork's own tokens (its parent ending mid-block or on a
boundary), and eviction dropping the scores."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.block_pool import BlockPool, BlockScores
from parrot_backend.engine.engine import Engine

from .test_prompt_logprobs import _check_prompt, _generate, _prefill, _prompt, reference

__all__ = ["reference"]  # the module fixture, used by the tests below


def _engine(tiny_model_dir, **kw) -> Engine:
    kw = {"num_blocks": 96, "progress": False, "max_batched_tokens": 16, **kw}
    return Engine.from_pretrained(tiny_model_dir, **kw)


def _hits(engine) -> int:
    return engine.stats_now().prefix_cache_hits


def _reused(engine) -> int:
    return engine.stats_now().prompt_scores_reused


async def _score(engine, cid, tokens, k, parent=None, salt=None):
    """One scoring fill in a context of its own: (entries, tokens computed, cache hits)."""
    prefill, hits = _prefill(engine), _hits(engine)
    filled = await engine.fill(cid, parent, tokens, prompt_logprobs=k, salt=salt)
    computed, taken = _prefill(engine) - prefill, _hits(engine) - hits
    return filled.prompt_logprobs, computed, taken


def test_the_same_prompt_scored_again_takes_its_blocks_and_scores(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 3 * bs + 5, seed=21)

    async def main():
        async with engine:
            first = await _score(engine, "a", prompt, 3)
            await engine.free("a")
            reused = engine.stats_now().prompt_scores_reused
            second = await _score(engine, "b", prompt, 3)
            await engine.free("b")
            return first, second, (reused, engine.stats_now().prompt_scores_reused)

    (e1, c1, h1), (e2, c2, h2), reused = asyncio.run(main())
    assert (c1, h1) == (len(prompt), 0)
    # the scores of the 3 blocks' tokens but the first (which has none) were taken
    assert reused == (0, 3 * bs - 1)
    # 3 cached blocks; the last of their positions is computed again to score the next
    assert h2 == 3 * bs and c2 == len(prompt) - 3 * bs + 1
    _check_prompt(e2, prompt, 3, reference)
    # the kept entries are the first fill's exactly (float32 both ways)
    assert e2[1 : 3 * bs] == e1[1 : 3 * bs]


def test_one_context_with_two_continuations(tiny_model_dir, reference):
    """lm-eval's multiple choice: the context's full blocks are computed once."""
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    context = _prompt(engine.vocab_size, 2 * bs + 9, seed=22)
    answers = [_prompt(engine.vocab_size, 7, seed=s) for s in (23, 24)]

    async def main():
        async with engine:
            out = []
            for i, answer in enumerate(answers):
                out.append(await _score(engine, f"c{i}", context + answer, 2))
                await engine.free(f"c{i}")
            return out

    (e1, c1, h1), (e2, c2, h2) = asyncio.run(main())
    assert h1 == 0 and c1 == len(context) + 7
    assert h2 == 2 * bs and c2 == len(context) + 7 - 2 * bs + 1
    _check_prompt(e1, context + answers[0], 2, reference)
    _check_prompt(e2, context + answers[1], 2, reference)


@pytest.mark.parametrize("blocks", [1, 8])
def test_two_concurrent_fills_of_one_prompt_compute_it_once(tiny_model_dir, reference, blocks):
    """The second waits a step for the blocks the first computes (plain fills do from 64
    tokens on; scoring fills from one block)."""
    engine = _engine(tiny_model_dir, max_batched_tokens=256)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, blocks * bs + 2, seed=25)

    async def main():
        async with engine:
            before, hits, reused = _prefill(engine), _hits(engine), _reused(engine)
            got = await asyncio.gather(
                engine.fill("x", None, prompt, prompt_logprobs=1),
                engine.fill("y", None, prompt, prompt_logprobs=1),
            )
            return got, (
                _prefill(engine) - before,
                _hits(engine) - hits,
                _reused(engine) - reused,
            )

    (x, y), (computed, hits, reused) = asyncio.run(main())
    assert computed == len(prompt) + (len(prompt) - blocks * bs + 1)
    # the blocks y took, counted once although y was matched again after its wait
    assert hits == blocks * bs and reused == blocks * bs - 1
    _check_prompt(x.prompt_logprobs, prompt, 1, reference)
    _check_prompt(y.prompt_logprobs, prompt, 1, reference)


def test_a_prompt_of_whole_blocks_computes_nothing_and_then_generates(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 3 * bs, seed=26)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main():
        async with engine:
            await _score(engine, "a", prompt, 0)
            first = await _generate(engine, "a", None, greedy)
            await engine.free("a")
            scored = await _score(engine, "b", prompt, 0)
            again = await _generate(engine, "b", None, greedy)
            await engine.free("b")
            return first, scored, again

    first, (entries, computed, taken), again = asyncio.run(main())
    assert computed == 0 and taken == len(prompt)
    _check_prompt(entries, prompt, 0, reference)
    assert [d.token_id for d in again] == [d.token_id for d in first]


def test_a_larger_top_k_computes_and_a_smaller_one_slices(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 2 * bs + 3, seed=27)

    async def main():
        async with engine:
            out = []
            for i, k in enumerate((1, 4, 2, 4)):
                out.append(await _score(engine, f"k{i}", prompt, k))
                await engine.free(f"k{i}")
            return out

    runs = asyncio.run(main())
    # k=1 computes; k=4 finds only top-1 scores: computes; k=2 and k=4 take the top-4 ones
    assert [taken for _, _, taken in runs] == [0, 0, 2 * bs, 2 * bs]
    for (entries, _, _), k in zip(runs, (1, 4, 2, 4), strict=True):
        _check_prompt(entries, prompt, k, reference)


def test_other_salt_cache_off_and_a_plain_fill_give_no_scores(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir)
    off = _engine(tiny_model_dir, prefix_cache=False)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 2 * bs + 3, seed=28)
    plain = _prompt(engine.vocab_size, 2 * bs + 3, seed=29)

    async def main(e):
        async with e:
            await _score(e, "a", prompt, 1, salt="tenant-a")
            other = await _score(e, "b", prompt, 1, salt="tenant-b")
            await e.fill("p", None, plain)  # KV cached, no scores
            unscored = await _score(e, "q", plain, 1)
            return other, unscored

    for e in (engine, off):
        (entries, computed, taken), (entries2, computed2, taken2) = asyncio.run(main(e))
        assert taken == taken2 == 0 and computed == computed2 == len(prompt)
        _check_prompt(entries, prompt, 1, reference)
        _check_prompt(entries2, plain, 1, reference)


@pytest.mark.parametrize("parent_len", [21, 32])
def test_a_fork_takes_kept_scores_of_its_own_tokens(tiny_model_dir, reference, parent_len):
    """A fill after a parent's tokens scores from its second token: a block holding parent
    tokens keeps the entries of the fill's tokens in it, and a later fill of the same
    tokens on that parent takes them (also replacing the parent's partial block)."""
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    prefix = _prompt(engine.vocab_size, parent_len, seed=30)
    question = _prompt(engine.vocab_size, 3 * bs, seed=31)

    async def main():
        async with engine:
            await engine.fill("p", None, prefix)
            first = await _score(engine, "q1", question, 2, parent="p")
            await engine.free("q1")
            second = await _score(engine, "q2", question, 2, parent="p")
            return first, second

    (e1, c1, h1), (e2, c2, h2) = asyncio.run(main())
    assert c1 == len(question)
    total = parent_len + len(question)
    end = total // bs * bs
    assert h2 == end - parent_len // bs * bs
    assert c2 == (total - end + 1 if end < total else 0)
    _check_prompt(e2, question, 2, reference, before=prefix)
    assert e2 == e1 or all(
        a == b for a, b in zip(e1[1 : end - parent_len], e2[1 : end - parent_len], strict=True)
    )


def test_evicting_a_block_drops_its_scores():
    pool = BlockPool(2, 4)
    b = pool.allocate()
    h = pool.register(b, 0, (1, 2, 3, 4))
    entries = [None, (-1.0, [(5, -0.5)]), (-2.0, [(6, -0.25)]), (-3.0, [(7, -0.125)])]
    pool.keep_scores(h, 1, 1, entries)
    kept = pool.cached_scores(h, 1, 1)
    # a larger top k, or entries from an earlier token, are not there
    assert kept is not None and pool.cached_scores(h, 2, 1) is pool.cached_scores(h, 1) is None
    pool.keep_scores(h, 1, 2, [None, None, *entries[2:]])  # fewer entries: not kept
    assert pool.cached_scores(h, 1, 1) is kept
    assert kept.entry(2, 1) == (-2.0, [(6, -0.25)]) and kept.entry(2, 0) == (-2.0, [])
    assert math.isnan(kept.chosen[0])
    pool.keep_scores(12345, 1, 1, entries)  # a hash no block caches: not kept
    assert 12345 not in pool.scores
    pool.decref(b)  # free, still cached
    assert pool.cached_scores(h, 1, 1) is kept
    pool.allocate(), pool.allocate()  # reuses b: its hash goes, and its scores
    assert pool.scores == {}


def test_packed_scores_are_exact_in_float32():
    row = torch.log_softmax(torch.randn(50), -1)
    values, ids = torch.topk(row, 3)
    entry = (float(row[7]), list(zip(ids.tolist(), values.tolist(), strict=True)))
    packed = BlockScores.pack(3, 0, [entry, entry])
    assert packed.entry(1, 3) == entry


@pytest.mark.parametrize("k", [0, 5])
def test_packing_keeps_k(k):
    entry = (-1.25, [(i, -float(i)) for i in range(k)])
    assert BlockScores.pack(k, 1, [None, entry]).entry(1, k) == entry
