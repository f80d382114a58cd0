"""The engine counts prefill tokens (prompt KV computed) apart from decode tokens (the KV of
sampled tokens): `EngineStats.prefill_tokens_computed`, exported on /metrics."""

from __future__ import annotations

import asyncio

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

GEN = SamplingParams(max_tokens=5, ignore_eos=True)


def _run(engine: Engine, coro):
    async def go():
        async with engine:
            return await coro()

    return asyncio.run(go())


def test_prompt_tokens_count_as_prefill_and_sampled_tokens_do_not(tiny_model_dir):
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, prefix_cache=False, progress=False
    )

    async def work():
        await engine.fill("p", None, list(range(3, 43)))  # 40 prompt tokens
        await engine.fill("a", "p", list(range(50, 58)))  # a fork adds 8 of its own
        got = [d async for d in engine.generate("a", None, GEN)]
        assert len(got) == 5
        await engine.fill("b", "a", list(range(60, 63)))  # 3 more after the generation
        got = [d async for d in engine.generate("b", None, GEN)]
        assert len(got) == 5
        return engine.stats_now()

    stats = _run(engine, work)
    # prefill: 40 + 8 + 3 (the forks reuse their parent's KV); decode: the KV of the
    # sampled tokens that were fed back (a generation's last token never is, except
    # where a later fill on the context computes it: a's 5th, computed with b's prompt)
    assert stats.prefill_tokens_computed == 40 + 8 + 3 + 1
    assert stats.tokens_computed == stats.prefill_tokens_computed + 4 + 4
    assert stats.tokens_generated == 10
