"""A prefix fill the filling call does not wait for (an engine that `joins_forks`): when the
fill fails after it was sent, the call that started it fails with the fill's error,
recorded as any call failure, and the calls that forked from the prefix meanwhile still
get the values they get alone (the engine computes what the fill did not). Real engine,
tiny model, token cache off; and `Attached.settle` / `abandon` on their own."""

from __future__ import annotations

import asyncio

import pytest
from test_e2e_engine import GEN, load, reference, spec  # (tests/manager is on the path)

from parrot_backend.manager.manager import Manager
from parrot_backend.manager.sharing import Attached, PrefixUnavailable

USERS = 3
SYSTEM = "You are a helpful assistant for a bird shop; answer in one line. " * 3


def _job():
    job = spec(
        [
            (f"u{i}", SYSTEM + f"User: {{{{input:q{i}}}}} Answer: {{{{output:a{i}}}}}")
            for i in range(USERS)
        ],
        {f"q{i}": f"what do parrots eat, part {i}?" for i in range(USERS)},
        "a0",
        **{f"u{i}": {f"a{i}": GEN} for i in range(USERS)},
    )
    job.outputs = {f"a{i}": "latency" for i in range(USERS)}
    return job


async def test_a_prefix_fill_failing_after_it_was_sent_fails_its_filler_only(tiny_model_dir):
    job = _job()
    (want,), _ = await reference(tiny_model_dir, job)
    engine = load(tiny_model_dir)
    assert engine.joins_forks
    real_fill = engine.fill

    async def fill(context_id, parent_id, token_ids, **kw):
        n = await real_fill(context_id, parent_id, token_ids, **kw)
        if str(context_id).startswith("pfx:"):
            raise RuntimeError("the prefix broke after it was sent")
        return n

    engine.fill = fill
    async with engine, Manager({"e0": engine}) as manager:
        rid = await manager.create_run(job)
        async for _ in manager.subscribe(rid):
            pass
        status = manager.run_status(rid)
        calls = {name: manager.runs[rid].calls[name] for name in status.calls}
    failed = {n: c.error for n, c in calls.items() if c.state == "failed"}
    assert len(failed) == 1, failed  # the filler: its first token waited for the fill
    (error,) = failed.values()
    assert "the prefix broke after it was sent" in error
    for i in range(USERS):
        if f"u{i}" not in failed:
            assert status.values[f"a{i}"] == want[f"a{i}"]
    assert manager.sharing.fills["e0"] == 0  # the broken prefix is not counted as filled


async def test_settle_raises_the_fill_error_and_a_cancelled_fill_is_unavailable():
    async def broken():
        await asyncio.sleep(0)
        raise RuntimeError("no room")

    failing = Attached("c", 4, pending=[asyncio.ensure_future(broken())])
    with pytest.raises(RuntimeError, match="no room"):
        await failing.settle()

    cancelled = Attached("c", 4, pending=[asyncio.ensure_future(asyncio.sleep(10))])
    cancelled.pending[0].cancel()
    with pytest.raises(PrefixUnavailable, match="cancelled"):
        await cancelled.settle()

    ok = Attached("c", 4, pending=[asyncio.ensure_future(asyncio.sleep(0))])
    await ok.settle()
    assert ok.pending == []

    slow = asyncio.ensure_future(asyncio.sleep(10))
    going = Attached("c", 4, pending=[slow])
    await going.abandon()
    assert slow.cancelled() and going.pending == []


async def test_a_call_cancelled_while_it_settles_is_cancelled():
    slow = asyncio.ensure_future(asyncio.sleep(10))
    waiting = Attached("c", 4, pending=[slow])
    task = asyncio.ensure_future(waiting.settle())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not slow.cancelled()  # shielded: the call's own cleanup abandons it
    await waiting.abandon()
