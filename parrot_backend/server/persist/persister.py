"""`StorePersister`: the run listener that commits each manager event before it is seen.

Each event's store work is one transaction, together with what the run had buffered
(`buffer.py`). When it fails, nothing of it was written: the buffered events and call
ends go back into the buffers (in order) for the next write or flush, and the event
itself fails to the manager. A write whose task is cancelled (a run cancelled mid-write)
still runs to its end in its thread; the task waits for it under the run's lock, so a
run's transactions never overlap (on PostgreSQL, overlapping ones deadlocked).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from parrot_backend.store import Store

from ..notify import Notifier
from .buffer import WriteBuffer
from .handlers import HANDLERS, on_other
from .leases import renew_leases
from .meta import RunMeta

T = TypeVar("T")


async def run_to_end(fut: asyncio.Future[T], on_success: Callable[[T], None] | None) -> T:
    """Await a store call running in a thread, to its end even when the awaiting task is
    cancelled: the thread goes on and commits whatever happens to the task, so the task
    must not let go of the run's lock, nor put back into the buffers what was written,
    before the transaction is over. `on_success(result)` runs once it committed (also
    when cancelled); a cancellation is raised after that."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            cancelled = True  # the task was cancelled: the write goes on; wait for it
        except BaseException:
            break  # the write failed: fut holds its exception
    if fut.exception() is None and on_success is not None:
        on_success(fut.result())
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


class StorePersister:
    """Commits manager events to a `Store`. One per server process (`worker` names it)."""

    def __init__(
        self,
        store: Store,
        worker: str,
        notifier: Notifier,
        *,
        flush_interval_s: float = 0.02,
        lease_s: float = 60.0,
        owner_lease_s: float = 30.0,
    ) -> None:
        self.store = store
        self.owner_lease_s = owner_lease_s  # how long this process holds its runs unrenewed
        self.worker = worker
        self.notifier = notifier
        self.lease_s = lease_s
        self.runs: dict[str, RunMeta] = {}
        self.frozen = False  # set on shutdown: later events are not persisted
        self.buffer = WriteBuffer(store, worker, self.runs, notifier, self._db, flush_interval_s)
        self._tasks: list[asyncio.Task[None]] = []
        # SQLite has one writer: concurrent write transactions from several threads only
        # wait for each other in the busy handler's sleeps (milliseconds each). One writer
        # thread queues them instead. PostgreSQL takes a few in parallel.
        writers = 1 if store.dialect == "sqlite" else 4
        self._writer = ThreadPoolExecutor(writers, thread_name_prefix="parrot-store")

    async def _db(
        self,
        fn: Callable[..., T],
        *args: Any,
        on_success: Callable[[T], None] | None = None,
        **kw: Any,
    ) -> T:
        """Run a store call on the writer thread(s), to its end (`run_to_end`)."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._writer, functools.partial(fn, *args, **kw))
        return await run_to_end(fut, on_success)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the flusher and the lease renewer on the running loop."""
        self._tasks = [
            asyncio.create_task(self.buffer.run(), name="parrot-flush"),
            asyncio.create_task(
                renew_leases(self.store, self.worker, self.runs, self._db, self.lease_s),
                name="parrot-lease",
            ),
        ]

    async def stop(self) -> None:
        """Flush what is buffered, then stop; events after this are not persisted (the
        store keeps those runs unfinished, and the next start resumes them)."""
        await self.flush_all()
        self.frozen = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._writer.shutdown(wait=True)

    def expect(self, run_id: str, meta: RunMeta) -> None:
        """Register a run before the manager creates it (its `run_created` needs this)."""
        self.runs[run_id] = meta

    def drop(self, run_id: str) -> None:
        """Forget a run (created failed, or the manager forgot it)."""
        self.runs.pop(run_id, None)

    async def flush_all(self) -> None:
        """Write every run's buffered events and call ends now (`WriteBuffer.flush_all`)."""
        await self.buffer.flush_all()

    # ------------------------------------------------------------------ the listener
    async def on_event(self, run_id: str, type: str, payload: dict[str, Any]) -> None:
        """Persist one event; returns once it is committed (tokens: once buffered)."""
        if self.frozen:
            return
        meta = self.runs.get(run_id)
        if meta is None:
            raise RuntimeError(f"run {run_id} was not announced to the persister")
        if type == "token":
            self.buffer.add_token(meta, payload)
            return
        if type == "call_finished":  # recorded with the run's next write (buffer.py)
            self.buffer.add_finish(meta, payload)
            return
        async with meta.lock:
            # the run's buffered events go first, in the same transaction as this event
            # (one commit instead of two, and the log keeps the manager's order)
            events = [*meta.buffered, (type, payload)]
            meta.buffered = []
            await self._write(run_id, meta, type, payload, events)
        self.notifier.wake(run_id)

    async def on_values(self, run_id: str, payloads: list[dict[str, Any]]) -> None:
        """Persist several `variable_ready` events of one run in one transaction (the
        manager groups the values that arrive together); returns once committed."""
        if len(payloads) == 1:
            await self.on_event(run_id, "variable_ready", payloads[0])
            return
        if self.frozen:
            return
        meta = self.runs.get(run_id)
        if meta is None:
            raise RuntimeError(f"run {run_id} was not announced to the persister")
        async with meta.lock:
            events = [*meta.buffered, *(("variable_ready", p) for p in payloads)]
            meta.buffered = []
            group = {"values": payloads}
            await self._write(run_id, meta, "variables_ready", group, events, own=len(payloads))
        self.notifier.wake(run_id)

    async def _write(
        self,
        run_id: str,
        meta: RunMeta,
        type: str,
        payload: dict,
        events: list[tuple[str, Any]],
        own: int = 1,
    ) -> None:
        """Run the event's handler: its store work is one transaction (`txn`), with the
        run's buffered events and call ends. When that transaction fails, they are put
        back in the buffers for the next write; the event itself (the last `own` events)
        fails to the manager."""
        finishes, meta.finishes = meta.finishes, []
        meta.pending, meta.committed = finishes, False
        handler = HANDLERS.get(type, on_other)
        try:
            await handler(self, run_id, meta, payload, events)
        except BaseException:
            if not meta.committed:
                meta.finishes[:0] = finishes
                meta.buffered[:0] = events[: len(events) - own]
            raise
        finally:
            meta.pending = []

    async def txn(self, meta: RunMeta, work: Callable[[], T], *, single: bool = False) -> T:
        """An event's store work (a closure run on the writer thread), in one transaction
        with the run's buffered call ends. Once per handler."""

        def committed(_: object) -> None:
            meta.committed = True

        return await self._db(self.buffer.batched, meta.pending, work, single, on_success=committed)

    async def refresh_call_ids(self, run_id: str, meta: RunMeta) -> None:
        """Reload the call name -> store id map of a run."""
        detail = await self._db(self.store.get_run, meta.tenant_id, run_id)
        meta.set_calls(detail.calls)
        meta.program = dict(detail.program)
