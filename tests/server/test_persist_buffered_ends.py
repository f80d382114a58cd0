"""StorePersister: buffered events and call ends survive a failed write and land with the
next one, in order."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from parrot_backend.program import ProgramSpec
from parrot_backend.server.notify import Notifier
from parrot_backend.server.persist import RunMeta, StorePersister
from parrot_backend.store import Store

from .native_support import migrated_sqlite

PROGRAM = ProgramSpec.model_validate(
    {
        "calls": [
            {"name": "a", "template": "A {{input:x}} {{output:y}}"},
            {"name": "b", "template": "B {{input:y}} {{output:z}}"},
        ]
    }
).model_dump(mode="json")


@contextlib.asynccontextmanager
async def started(tmp_path) -> AsyncIterator[tuple[Store, int, StorePersister]]:
    """A persister (flushing only when told) with run r1 created and call a started."""
    store = Store(migrated_sqlite(tmp_path))
    tenant = store.ensure_tenant("t").id
    p = StorePersister(store, "w", Notifier(), flush_interval_s=3600)
    p.start()
    try:
        p.expect("r1", RunMeta(tenant))
        await p.on_event(
            "r1",
            "run_created",
            {"program": PROGRAM, "inputs": {"x": "1"}, "outputs": {"z": "latency"}, "open": False},
        )
        await p.on_event("r1", "call_started", {"call": "a", "engine": "e0"})
        await p.on_event("r1", "token", {"call": "a", "variable": "y", "text": "2"})
        yield store, tenant, p
    finally:
        await p.stop()
        store.close()


def broken(*args, **kw):
    raise RuntimeError("database hiccup")


async def test_a_failed_write_keeps_buffered_call_ends_for_the_next_one(tmp_path) -> None:
    async with started(tmp_path) as (store, tenant, p):
        await p.on_event("r1", "variable_ready", {"name": "y", "value": "2", "call": "a"})
        await p.on_event("r1", "call_finished", {"call": "a", "completion_tokens": 1})
        assert store.get_run(tenant, "r1").calls[0].status == "running"  # buffered

        real = store.hold_call
        store.hold_call = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="hiccup"):
            await p.on_event("r1", "call_started", {"call": "b", "engine": "e0"})
        assert store.get_run(tenant, "r1").calls[0].status == "running"  # rolled back
        assert len(p.runs["r1"].finishes) == 1  # kept for the next write
        assert [t for t, _ in p.runs["r1"].buffered] == ["call_finished"]

        store.hold_call = real  # type: ignore[method-assign]
        await p.on_event("r1", "call_started", {"call": "b", "engine": "e0"})
        a, b = store.get_run(tenant, "r1").calls
        assert (a.status, a.completion_tokens, b.status) == ("done", 1, "running")
        assert a.first_token_at is not None and a.finished_at <= b.started_at
        assert p.runs["r1"].finishes == []
        await p.on_event("r1", "variable_ready", {"name": "z", "value": "3", "call": "b"})
        await p.on_event("r1", "call_finished", {"call": "b", "completion_tokens": 1})
        await p.flush_all()  # no later event: the flusher writes it
        assert store.get_run(tenant, "r1").calls[1].status == "done"
        # nothing lost: the failed write's buffered end went with the retry, in order
        types = [e.type for e in store.read_events(tenant, "r1")]
        assert types == [
            "run_created",
            "call_started",
            "token",
            "variable_ready",
            "call_finished",
            "call_started",
            "variable_ready",
            "call_finished",
        ]


async def test_a_failed_flush_keeps_its_batch_for_the_next(tmp_path) -> None:
    async with started(tmp_path) as (store, tenant, p):
        real = store.append_events
        store.append_events = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="hiccup"):
            await p.flush_all()
        await p.on_event("r1", "token", {"call": "a", "variable": "y", "text": "3"})
        store.append_events = real  # type: ignore[method-assign]
        await p.flush_all()
        texts = [e.payload["text"] for e in store.read_events(tenant, "r1") if e.type == "token"]
        assert texts == ["2", "3"]


async def test_a_cancelled_write_finishes_under_the_runs_lock_and_is_written_once(
    tmp_path,
) -> None:
    """A task cancelled while its transaction runs (a run cancelled mid-write): the thread
    commits anyway, so the task keeps the run's lock until it has, and what it wrote is
    not put back into the buffers to be written twice. Before, the lock was let go at
    once (on PostgreSQL, the run's next write raced the running one: a 500 on cancel in
    the chaos test) and the committed events were written again."""
    import asyncio
    import threading

    async with started(tmp_path) as (store, tenant, p):
        await p.on_event("r1", "variable_ready", {"name": "y", "value": "2", "call": "a"})
        await p.on_event("r1", "call_finished", {"call": "a", "completion_tokens": 1})
        gate, entered = threading.Event(), threading.Event()
        real = store.hold_call

        def slow(*args, **kw):
            entered.set()
            assert gate.wait(30)
            return real(*args, **kw)

        store.hold_call = slow  # type: ignore[method-assign]
        task = asyncio.create_task(p.on_event("r1", "call_started", {"call": "b", "engine": "e0"}))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        assert not done, "the task let go while its transaction still ran"
        assert p.runs["r1"].lock.locked()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not p.runs["r1"].lock.locked()
        assert p.runs["r1"].buffered == [] and p.runs["r1"].finishes == []
        store.hold_call = real  # type: ignore[method-assign]
        await p.on_event("r1", "variable_ready", {"name": "z", "value": "3", "call": "b"})
        types = [e.type for e in store.read_events(tenant, "r1")]
        assert types == [
            "run_created",
            "call_started",
            "token",
            "variable_ready",
            "call_finished",
            "call_started",
            "variable_ready",
        ]
        a, b = store.get_run(tenant, "r1").calls
        assert (a.status, b.status) == ("done", "running")


async def test_a_cancelled_flush_that_committed_is_not_written_again(tmp_path) -> None:
    import asyncio
    import threading

    async with started(tmp_path) as (store, tenant, p):
        gate, entered = threading.Event(), threading.Event()
        real = store.append_events

        def slow(*args, **kw):
            entered.set()
            assert gate.wait(30)
            return real(*args, **kw)

        store.append_events = slow  # type: ignore[method-assign]
        task = asyncio.create_task(p.flush_all())
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.append_events = real  # type: ignore[method-assign]
        await p.flush_all()
        texts = [e.payload["text"] for e in store.read_events(tenant, "r1") if e.type == "token"]
        assert texts == ["2"]
