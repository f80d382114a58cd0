"""A context freed, or its request cancelled, while a step that uses it runs: the step
finishes on what it was given, the free takes effect, and the engine keeps serving.

Before the step's inputs were copied out of the contexts, the compute thread read a
context's block table while the event loop freed it: an IndexError in the runner killed
the engine (seen with cancelled runs and closed streaming chat completions)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from parrot_backend.contract.errors import (
    EngineDead,
    EngineError,
    RequestCancelled,
    StepFailed,
)
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

from .helpers import collect

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def _gate(engine):
    """Hold every step on the compute thread until `release` is set."""
    entered, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def gated(batch, should_pause=None):
        entered.set()
        assert release.wait(30), "the test never released the step"
        return execute(batch, should_pause)

    engine.runner.execute = gated
    return entered, release


async def _quiet(engine, prompt, sampling):
    await engine.fill("quiet", None, prompt)
    tokens, _, _ = await collect(engine, "quiet", None, sampling)
    await engine.free("quiet")
    return tokens


def test_a_context_freed_during_its_step_is_freed_after_it(engine):
    async def go():
        async with engine:
            a, b = _prompt(40, 1), _prompt(24, 2)
            expected = await _quiet(engine, b, GREEDY)
            await engine.fill("a", None, a)
            await engine.fill("b", None, b)
            entered, release = _gate(engine)
            gen_a = engine.generate("a", None, SamplingParams(max_tokens=50, ignore_eos=True))
            first = asyncio.ensure_future(anext(gen_a))
            other = asyncio.ensure_future(collect(engine, "b", None, GREEDY))
            await asyncio.to_thread(entered.wait, 10)
            # the step holding both sequences is on the compute thread now
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await gen_a.aclose()
            await engine.free("a")
            release.set()
            tokens, _, _ = await other
            await engine.free("b")
            return expected, tokens, engine.stats_now(), engine.error

    expected, tokens, stats, error = asyncio.run(go())
    assert error is None
    assert tokens == expected
    assert stats.contexts == 0 and stats.blocks_used == 0 and stats.running == 0


def test_a_fill_freed_mid_step_fails_its_caller_only(engine):
    async def go():
        async with engine:
            entered, release = _gate(engine)
            fill = asyncio.ensure_future(engine.fill("f", None, _prompt(64, 3)))
            await asyncio.to_thread(entered.wait, 10)
            fill.cancel()
            await asyncio.gather(fill, return_exceptions=True)
            await engine.free("f")
            release.set()
            tokens = await _quiet(engine, _prompt(10, 4), GREEDY)
            return tokens, engine.stats_now(), engine.error

    tokens, stats, error = asyncio.run(go())
    assert error is None and len(tokens) == 6
    assert stats.contexts == 0 and stats.blocks_used == 0


def test_random_cancels_and_frees_never_kill_the_engine(engine):
    """Many tasks fill, fork, generate, cancel and free at random points of their steps."""

    async def worker(i: int, rng: random.Random) -> int:
        cid = f"w{i}"
        done = 0
        for j in range(6):
            ctx = f"{cid}-{j}"
            try:
                fill = asyncio.ensure_future(
                    engine.fill(ctx, None, _prompt(rng.randint(2, 60), i * 7 + j))
                )
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.01)
                    fill.cancel()
                await asyncio.gather(fill, return_exceptions=True)
                if rng.random() < 0.5:
                    child = f"{ctx}/c"
                    gen = engine.generate(
                        child, ctx, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
                    )
                else:
                    child = None
                    gen = engine.generate(
                        ctx,
                        None,
                        SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.8, seed=j),
                    )
                limit = rng.randint(0, 8)
                n = 0
                try:
                    async for _ in gen:
                        n += 1
                        if n >= limit:
                            break
                except RequestCancelled:
                    pass
                finally:
                    await gen.aclose()
                if child is not None:
                    await engine.free(child)
                await engine.free(ctx)
                done += 1
            except EngineError as exc:
                assert not isinstance(exc, EngineDead), exc
                # a cancelled fill leaves an empty context that generate refuses: fine
                for c in (f"{ctx}/c", ctx):
                    if c in engine.contexts:
                        await engine.free(c)
        return done

    async def go():
        async with engine:
            rng = random.Random(12)
            done = await asyncio.gather(*(worker(i, random.Random(rng.random())) for i in range(8)))
            return sum(done), engine.stats_now(), engine.error

    done, stats, error = asyncio.run(go())
    assert error is None
    assert done > 0
    assert stats.contexts == 0 and stats.blocks_used == 0 and stats.running == 0
    assert stats.waiting == 0


def _poison(engine, token_id):
    """The model raises on any step whose batch holds `token_id` (its embedding, which a
    step run whole and one run layer by layer both begin with)."""
    model = engine.runner.model.model
    embed = model.embed

    def broken(ids, *args, **kw):
        if bool((ids == token_id).any()):
            raise RuntimeError("poisoned token")
        return embed(ids, *args, **kw)

    model.embed = broken


def test_a_request_that_breaks_the_step_fails_alone(engine):
    async def go():
        async with engine:
            good = _prompt(20, 5)
            expected = await _quiet(engine, good, GREEDY)
            bad = [*_prompt(8, 6), 7]
            await engine.fill("good", None, good)
            _poison(engine, 7)
            results = await asyncio.gather(
                engine.fill("bad", None, bad),
                collect(engine, "good", None, GREEDY),
                return_exceptions=True,
            )
            await engine.free("bad")
            await engine.free("good")
            return expected, results, engine.error

    expected, (bad, good), error = asyncio.run(go())
    assert error is None
    assert isinstance(bad, StepFailed) and "poisoned" in str(bad)
    assert good[0] == expected


def test_a_broken_device_kills_the_engine_with_engine_dead(engine):
    async def go():
        async with engine:
            await engine.fill("x", None, _prompt(8, 7))
            _poison(engine, 7)

            def broken_probe():
                raise RuntimeError("device lost")

            engine._probe_device = broken_probe
            with pytest.raises(EngineDead):
                await engine.fill("y", None, [7, 7])
            with pytest.raises(EngineDead):
                await engine.fill("z", None, [5])
            return engine.error

    assert "device lost" in repr(asyncio.run(go()))
