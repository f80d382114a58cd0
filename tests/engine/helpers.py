"""Helpers for engine tests."""

from __future__ import annotations

import asyncio

from parrot_backend.contract.sampling import SamplingParams


async def collect(engine, cid, parent, sampling: SamplingParams, **kw):
    """Run one generation; return (token ids, concatenated text, deltas)."""
    deltas = [d async for d in engine.generate(cid, parent, sampling, **kw)]
    return (
        [d.token_id for d in deltas if d.finish_reason is None or d.token_id is not None],
        "".join(d.text for d in deltas),
        deltas,
    )


async def complete(engine, cid, prompt_ids, sampling: SamplingParams, parent=None):
    """Fill a prompt into a new context and generate; returns generated token ids."""
    await engine.fill(cid, parent, prompt_ids)
    deltas = [d async for d in engine.generate(cid, None, sampling)]
    return [d.token_id for d in deltas]


def run(coro):
    return asyncio.run(coro)
