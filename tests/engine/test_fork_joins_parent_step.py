"""A fork submitted while its parent's fill is queued joins the step that completes the
fill (`Scheduler.joined`): one step instead of two, the same tokens as an unshared
prompt, and a fork whose parent's work fails in that step fails with it. The tiny random
model, block size 16, the engine's token-level prefix cache off (it is the case with no
other way to skip the step) and on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parrot_backend.contract.errors import StepFailed
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

from .helpers import collect

GEN = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 200 for i in range(n)]


def _engine(tiny_model_dir, **kw) -> Engine:
    kw.setdefault("prefix_cache", False)
    return Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False, **kw)


async def _alone(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of the whole prompt in one context of its own (the plain path), and
    the engine steps that took."""
    steps = engine.stats_now().steps
    await engine.fill("alone", None, prompt)
    ids, _, _ = await collect(engine, "alone", None, GEN)
    await engine.free("alone")
    return ids, engine.stats_now().steps - steps


def _same_partial_block(engine: Engine, fork: str) -> None:
    """The fork's own copy of its parent's partial last block holds the parent's KV."""
    child, parent = engine.contexts[fork], engine.contexts["p"]
    bs = engine.pool.block_size
    k, n = child.fork_len // bs, child.fork_len % bs
    assert n and child.blocks[k] != parent.blocks[k]
    for kc, vc in engine.runner.kv_caches:
        for cache in (kc, vc):
            assert bool(cache[parent.blocks[k], :n].abs().sum() > 0)
            assert torch.equal(cache[child.blocks[k], :n], cache[parent.blocks[k], :n])


async def _forked(engine: Engine, head: list[int], tails: list[list[int]], check=None):
    """Fill `head` and, without waiting for it, fork each tail from it and generate."""

    async def fork(i: int, tail: list[int]) -> list[int]:
        await engine.fill(f"f{i}", "p", tail)
        if check is not None:
            check(engine, f"f{i}")
        ids, _, _ = await collect(engine, f"f{i}", None, GEN)
        return ids

    # the parent's fill and the forks are submitted before the engine plans (tasks run in
    # the order they were made), as the manager's call submits its fork after its prefix
    filled = asyncio.ensure_future(engine.fill("p", None, head))
    forks = [asyncio.ensure_future(fork(i, t)) for i, t in enumerate(tails)]
    outs = await asyncio.gather(*forks)
    await filled
    for i in range(len(tails)):
        await engine.free(f"f{i}")
    await engine.free("p")
    return outs


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("head_len", [40, 32])  # ends mid-block / on a block boundary
def test_forks_join_the_step_that_fills_their_parent(tiny_model_dir, prefix_cache, head_len):
    head = _prompt(head_len, 1)
    tails = [_prompt(7, 2), _prompt(9, 3)]

    async def go():
        engine = _engine(tiny_model_dir, prefix_cache=prefix_cache)
        async with engine:
            expected = [await _alone(engine, head + t) for t in tails]
            before = engine.stats_now()
            got = await _forked(engine, head, tails)
            after = engine.stats_now()
        return expected, got, before, after

    expected, got, before, after = asyncio.run(go())
    # the joined forks read the parent's KV of their own step
    assert got == [ids for ids, _ in expected]
    # one step fills the parent and both forks' tails: as many steps as one prompt alone
    # (without joining, the forks' tails took a step of their own)
    assert after.steps - before.steps == expected[0][1]
    # no token is computed twice: the forks' copies of the parent's partial last block
    # get the parent's KV of this step written twice
    if not prefix_cache:
        prefill = after.prefill_tokens_computed - before.prefill_tokens_computed
        assert prefill == head_len + sum(len(t) for t in tails)


def test_a_parent_filled_in_chunks_is_joined_at_its_last_chunk(tiny_model_dir):
    head = _prompt(70, 4)
    tail = _prompt(5, 5)

    async def go():
        engine = _engine(tiny_model_dir, max_batched_tokens=33)
        async with engine:
            expected = await _alone(engine, head + tail)
            before = engine.stats_now()
            copied = engine.scheduler.join_copied
            (got,) = await _forked(engine, head, [tail], check=_same_partial_block)
            after = engine.stats_now()
            copied = engine.scheduler.join_copied - copied
        return expected, got, after.steps - before.steps, copied

    (expected, alone), got, steps, copied = asyncio.run(go())
    assert got == expected
    # 70 tokens in chunks of 33: three steps, the fork's 5 in the third, as the 75 tokens
    # alone take three. The fork's copy of the partial block (64-79) holds 64-65 from the
    # second step (copied before the third) and 66-69 written twice by the third.
    assert steps == alone
    assert copied == 4


def test_a_fork_fails_with_the_parent_work_of_the_step_it_joined(tiny_model_dir):
    poison = 7
    head = [*_prompt(20, 6), poison]  # the parent's own tokens break its work alone
    tail = _prompt(5, 7)

    async def go():
        engine = _engine(tiny_model_dir)
        async with engine:
            model = engine.runner.model.model  # every step begins with its embedding
            forward = model.embed

            def broken(ids, *args, **kw):
                if bool((ids == poison).any()):
                    raise RuntimeError("poisoned token")
                return forward(ids, *args, **kw)

            model.embed = broken
            filled = asyncio.ensure_future(engine.fill("p", None, head))
            fork = asyncio.ensure_future(engine.fill("f", "p", tail))
            forked = await asyncio.gather(fork, filled, return_exceptions=True)
            ctx = engine.contexts["f"]
            state = (list(ctx.blocks), ctx.num_computed)
            model.embed = forward
            # the fork's context is still usable: its tokens are recomputed in full
            ids, _, _ = await collect(engine, "f", None, GEN)
            await engine.free("f")
            await engine.free("p")
            return forked, state, ids, engine.error

    (fork_err, fill_err), state, ids, error = asyncio.run(go())
    assert error is None
    assert isinstance(fill_err, StepFailed) and "poisoned" in str(fill_err)
    assert isinstance(fork_err, StepFailed), fork_err
    assert state == ([], 0)  # no KV of the failed step is trusted
    assert len(ids) == GEN.max_tokens


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_forks_of_a_whole_prompt_sample_from_the_state_their_parent_kept(
    tiny_model_dir, prefix_cache
):
    """Users with the same prompt (the manager fills it once, as a prefix context, and
    forks each call from it with nothing of its own to fill; the forks are made before
    the prefix is computed). Their first tokens are sampled from the final hidden state
    the prefix's fill kept: no token is computed again for them, and no step is added to
    one prompt's."""
    head, tail = _prompt(40, 8), _prompt(9, 9)

    async def go():
        engine = _engine(tiny_model_dir, prefix_cache=prefix_cache)
        async with engine:
            expected, alone = await _alone(engine, head + tail)
            before = engine.stats_now()

            async def user(i: int) -> list[int]:
                ids, _, _ = await collect(engine, f"u{i}", "q", GEN)
                return ids

            filled = asyncio.ensure_future(engine.fill("p", None, head))
            question = asyncio.ensure_future(engine.fill("q", "p", tail))
            await asyncio.sleep(0)  # "q" has its tail (a fork copies its tokens)
            got = await asyncio.gather(*(user(i) for i in range(3)))
            await asyncio.gather(filled, question)
            after = engine.stats_now()
            for cid in ("u0", "u1", "u2", "q", "p"):
                await engine.free(cid)
        return expected, alone, got, before, after

    expected, alone, got, before, after = asyncio.run(go())
    assert got == [expected] * 3
    assert after.steps - before.steps == alone
    if not prefix_cache:
        prefill = after.prefill_tokens_computed - before.prefill_tokens_computed
        assert prefill == len(head) + len(tail)
