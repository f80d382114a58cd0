"""Write-before-acknowledge: a `RunListener` that commits every manager event to the store.

The manager awaits `on_event` before the change it reports becomes visible (to `get`,
run status, event subscribers), so whatever a client can observe is already committed.
Store calls are synchronous SQLAlchemy units of work; they run in worker threads so the
event loop (and with it the engine's scheduling) never waits on the database.

Token events are the exception that keeps the store cheap: they are buffered and written
in batches by a background flusher (every `flush_interval_s`). Nothing reads tokens from
the manager's memory: SSE streams read the store's log, so a token is streamed only once
its batch committed. Any other event of a run is written in one transaction together
with the run's buffered tokens, placed before it (under a per-run lock), so the log
keeps the manager's order and a call's tokens are durable before its value or its end
are acknowledged. Tokens still buffered when the process dies were never streamed; the
call runs again after recovery. Store writes go to one writer thread on SQLite (its
single writer lock would otherwise make threads sleep in the busy handler).

A call's end (`call_finished`) is buffered like its tokens: it is recorded with the run's
next write (the next call's claim, the run's end) or the next flush, in the same
transaction. Nothing waits on it: its outputs were committed (and acknowledged) before
it, and recovery records the end of a call whose outputs are all set (`settle_calls`)
instead of running it again. That takes one commit per call off the critical path of
every step of a chain.

Each event's store work is one transaction, together with what the run had buffered.
When it fails, nothing of it was written: the buffered events and call ends go back
into the buffers (in order) for the next write or flush, and the event itself fails to
the manager. A failed flush is retried the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from parrot_backend.manager.runs import RunOwnedElsewhere
from parrot_backend.program import CallSpec
from parrot_backend.store import CallRecord, Store
from parrot_backend.store.columns import utcnow

from .notify import Notifier

log = logging.getLogger(__name__)
T = TypeVar("T")

# manager run_finished status -> store run status
_RUN_STATUS = {"finished": "done", "failed": "failed", "cancelled": "cancelled"}


@dataclass(slots=True)
class RunMeta:
    """What the persister must know about a run beyond the event payloads."""

    tenant_id: int
    workflow_id: int | None = None
    replay_of: str | None = None
    resumed: bool = False
    program: dict[str, Any] = field(default_factory=dict)  # merged program JSON
    call_ids: dict[str, int] = field(default_factory=dict)  # call name -> store id
    call_idx: dict[str, int] = field(default_factory=dict)  # call name -> index in run
    started: bool = False  # the store's run status is "running"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tokens: list[tuple[str, Any]] = field(default_factory=list)  # buffered events
    finishes: list[dict[str, Any]] = field(default_factory=list)  # buffered call ends
    pending: list[dict[str, Any]] = field(default_factory=list)  # ends taken by a write
    committed: bool = False  # the current write's transaction committed
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # call -> tokens
    first_token: dict[str, datetime] = field(default_factory=dict)  # recorded at the end

    def set_calls(self, calls: tuple[CallRecord, ...]) -> None:
        """Take the store ids and indices of the run's calls."""
        self.call_ids = {c.name: c.id for c in calls if c.name is not None}
        self.call_idx = {c.name: c.idx for c in calls if c.name is not None}


def _plain(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call specs as a client could send them: the manager's `#<index>` names of unnamed
    calls are dropped (they are not valid user names, and rebuilding gives them back)."""
    return [{**c, "name": None} if str(c.get("name") or "").startswith("#") else c
            for c in calls]


def _descriptors(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """The store's call descriptors (name, inputs, outputs, the types of typed outputs) of
    call specs, in order."""
    out = []
    for i, raw in enumerate(calls):
        call = CallSpec.model_validate(raw).build(first + i)
        desc: dict[str, Any] = {"name": call.name, "inputs": list(call.inputs),
                                "outputs": list(call.outputs)}
        types = {o: c.value_type for o, c in call.configs.items() if c.value_type != "text"}
        if types:
            desc["types"] = types
        out.append(desc)
    return out


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
        self.flush_interval_s = flush_interval_s
        self.lease_s = lease_s
        self.runs: dict[str, RunMeta] = {}
        self.frozen = False  # set on shutdown: later events are not persisted
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # SQLite has one writer: concurrent write transactions from several threads only
        # wait for each other in the busy handler's sleeps (milliseconds each). One writer
        # thread queues them instead. PostgreSQL takes a few in parallel.
        writers = 1 if store.dialect == "sqlite" else 4
        self._writer = ThreadPoolExecutor(writers, thread_name_prefix="parrot-store")

    async def _db(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a store call on the writer thread(s)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, functools.partial(fn, *args, **kw))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the token flusher and the lease renewer on the running loop."""
        self._tasks = [asyncio.create_task(self._flush_loop(), name="parrot-flush"),
                       asyncio.create_task(self._renew_loop(), name="parrot-lease")]

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

    # ------------------------------------------------------------------ the listener
    async def on_event(self, run_id: str, type: str, payload: dict[str, Any]) -> None:
        """Persist one event; returns once it is committed (tokens: once buffered)."""
        if self.frozen:
            return
        meta = self.runs.get(run_id)
        if meta is None:
            raise RuntimeError(f"run {run_id} was not announced to the persister")
        if type == "token":
            meta.tokens.append(("token", payload))
            call = payload["call"]
            meta.counts[call] += 1
            meta.first_token.setdefault(call, utcnow())
            self._dirty.set()
            return
        if type == "call_finished":  # recorded with the run's next write (module doc)
            meta.tokens.append((type, payload))
            meta.finishes.append(self._finish_args(meta, payload["call"]))
            self._dirty.set()
            return
        async with meta.lock:
            # the run's buffered events go first, in the same transaction as this event
            # (one commit instead of two, and the log keeps the manager's order)
            events = [*meta.tokens, (type, payload)]
            meta.tokens = []
            await self._write(run_id, meta, type, payload, events)
        self.notifier.wake(run_id)

    def _finish_args(self, meta: RunMeta, call: str) -> dict[str, Any]:
        """`Store.finish_call` arguments for a call that ended now."""
        return {"call_id": meta.call_ids[call], "worker": self.worker, "outputs": {},
                "completion_tokens": meta.counts.get(call, 0),
                "first_token_at": meta.first_token.pop(call, None), "now": utcnow()}

    def _record_finishes(self, finishes: list[dict[str, Any]]) -> None:
        for args in finishes:  # on the writer thread
            if not self.store.finish_call(**args).accepted:
                log.warning("call %s finished without holding its claim", args["call_id"])

    def _batched(self, finishes: list[dict[str, Any]], work: Callable[[], T],
                 single: bool) -> T:
        """Buffered call ends, then `work`, in one transaction (`single`: `work` is one
        store call, already one transaction: no batch is needed when nothing is buffered)."""
        if single and not finishes:
            return work()
        with self.store.batch(savepoints=False):
            self._record_finishes(finishes)
            return work()

    async def _write(self, run_id: str, meta: RunMeta, type: str, payload: dict,
                     events: list[tuple[str, Any]]) -> None:
        """Run the event's handler: its store work is one transaction (`_txn`), with the
        run's buffered events and call ends. When that transaction fails, they are put
        back in the buffers for the next write; the event itself fails to the manager."""
        finishes, meta.finishes = meta.finishes, []
        meta.pending, meta.committed = finishes, False
        handler = getattr(self, f"_on_{type}", self._on_other)
        try:
            await handler(run_id, meta, payload, events)
        except BaseException:
            if not meta.committed:
                meta.finishes[:0] = finishes
                meta.tokens[:0] = events[:-1]
            raise
        finally:
            meta.pending = []

    async def _txn(self, meta: RunMeta, work: Callable[[], T], *, single: bool = False) -> T:
        """The event's store work (a closure run on the writer thread), in one transaction
        with the run's buffered call ends. Once per handler."""
        result = await self._db(self._batched, meta.pending, work, single)
        meta.committed = True
        return result

    async def _on_other(self, run_id: str, meta: RunMeta, payload: dict,
                        events: list) -> None:
        """Any other event type: just log it."""
        rows = [(run_id, t, p) for t, p in events]
        await self._txn(meta, lambda: self.store.append_events(rows), single=True)

    async def _on_run_created(self, run_id: str, meta: RunMeta, payload: dict,
                              events: list) -> None:
        st = self.store
        if meta.resumed:
            # the rows exist; the manager re-announced the run while recovering it
            await self._txn(meta, lambda: st.append_event(run_id, "run_resumed", {}),
                            single=True)
            return
        program = dict(payload["program"])
        meta.program = program
        calls = _descriptors(program["calls"], 0)
        detail = await self._txn(meta, functools.partial(
            st.create_run, meta.tenant_id, program, calls, payload["inputs"],
            payload["outputs"], open=payload["open"], workflow_id=meta.workflow_id,
            replay_of=meta.replay_of, run_id=run_id, events=events, owner=self.worker,
            owner_lease_s=self.owner_lease_s), single=True)
        meta.set_calls(detail.calls)

    async def _on_calls_added(self, run_id: str, meta: RunMeta, payload: dict,
                              events: list) -> None:
        first = len(meta.program["calls"])
        added = _plain(payload["calls"])
        calls = _descriptors(added, first)
        program = {**meta.program, "calls": [*meta.program["calls"], *added]}
        await self._txn(meta, functools.partial(
            self.store.add_calls, meta.tenant_id, run_id, calls, program=program,
            events=events), single=True)
        meta.program = program
        await self.refresh_call_ids(run_id, meta)

    async def refresh_call_ids(self, run_id: str, meta: RunMeta) -> None:
        """Reload the call name -> store id map of a run."""
        detail = await self._db(self.store.get_run, meta.tenant_id, run_id)
        meta.set_calls(detail.calls)
        meta.program = dict(detail.program)

    async def _on_objectives(self, run_id: str, meta: RunMeta, payload: dict,
                             events: list) -> None:
        idx = meta.call_idx
        plans = {
            idx[name]: {"objective": o["objective"],
                        "task_group": None if o["group"] is None else str(o["group"])}
            for name, o in payload["calls"].items() if name in idx
        }
        await self._txn(meta, functools.partial(
            self.store.annotate_calls, run_id, plans, events=events), single=True)

    async def _on_run_closed(self, run_id: str, meta: RunMeta, payload: dict,
                             events: list) -> None:
        st = self.store

        def work() -> None:
            st.close_run(meta.tenant_id, run_id)
            st.append_events([(run_id, t, p) for t, p in events])

        await self._txn(meta, work)

    async def _on_call_started(self, run_id: str, meta: RunMeta, payload: dict,
                               events: list) -> None:
        st = self.store
        call = payload["call"]
        meta.counts[call] = 0
        meta.first_token.pop(call, None)
        first = not meta.started

        def work() -> bool:
            if first:  # the run's first call also marks it running
                st.set_run_status(run_id, "running")
            return st.hold_call(meta.call_ids[call], self.worker, engine=payload.get("engine"),
                                lease_s=self.lease_s, events=events)

        held = await self._txn(meta, work, single=not first)
        meta.started = True
        if not held:  # another process runs it: this manager must not, nor record anything
            self.drop(run_id)
            raise RunOwnedElsewhere(f"call {call!r} of run {run_id} is held by another worker")

    async def _on_variable_ready(self, run_id: str, meta: RunMeta, payload: dict,
                                 events: list) -> None:
        st = self.store

        def work() -> None:
            changed = st.set_variables(run_id, {payload["name"]: payload["value"]},
                                       events=events)
            if not changed and len(events) > 1:  # value was already there: keep the rest
                st.append_events([(run_id, t, p) for t, p in events[:-1]])

        await self._txn(meta, work, single=len(events) == 1)

    async def _on_variable_failed(self, run_id: str, meta: RunMeta, payload: dict,
                                  events: list) -> None:
        st = self.store

        def work() -> None:
            failed = st.fail_variable(run_id, payload["name"], payload["error"])
            kept = events if failed else events[:-1]
            if kept:
                st.append_events([(run_id, t, p) for t, p in kept])

        await self._txn(meta, work)

    async def _on_call_failed(self, run_id: str, meta: RunMeta, payload: dict,
                              events: list) -> None:
        st = self.store
        call_id = meta.call_ids[payload["call"]]

        def work() -> None:
            # a call failed because an input failed never ran: claim it to record the failure
            st.hold_call(call_id, self.worker, start=False, lease_s=self.lease_s)
            st.fail_call(call_id, self.worker, payload["error"], events=events)

        await self._txn(meta, work)

    async def _on_run_finished(self, run_id: str, meta: RunMeta, payload: dict,
                               events: list) -> None:
        st = self.store

        def work() -> None:
            changed = st.set_run_status(run_id, _RUN_STATUS[payload["status"]], events=events)
            if not changed and len(events) > 1:
                st.append_events([(run_id, t, p) for t, p in events[:-1]])

        await self._txn(meta, work, single=len(events) == 1)

    # ------------------------------------------------------------------ tokens
    async def flush_all(self) -> None:
        """Write every run's buffered events and call ends in one transaction (one commit
        per flush, however many runs are generating: commits, not rows, are what cost)."""
        dirty = sorted(r for r, m in self.runs.items() if m.tokens or m.finishes)
        if not dirty:
            return
        metas = [self.runs[r] for r in dirty]
        async with contextlib.AsyncExitStack() as stack:
            # sorted order; a listener holds one run's lock at a time, so no deadlock
            for meta in metas:
                await stack.enter_async_context(meta.lock)
            batch = [(r, t, p) for r, m in zip(dirty, metas, strict=True) for t, p in m.tokens]
            finishes = [f for m in metas for f in m.finishes]
            taken = [(m.tokens, m.finishes) for m in metas]
            for meta in metas:
                meta.tokens, meta.finishes = [], []
            try:
                await self._db(self._batched, finishes,
                               functools.partial(self.store.append_events, batch), True)
            except BaseException:  # nothing was written: back into the buffers
                for meta, (tokens, ends) in zip(metas, taken, strict=True):
                    meta.tokens[:0] = tokens
                    meta.finishes[:0] = ends
                raise
        for run_id in dirty:
            self.notifier.wake(run_id)

    async def _flush_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            try:
                await self.flush_all()
            except Exception:  # the batch went back into the buffers: try again later
                log.exception("writing buffered events failed; retrying")
                self._dirty.set()
                await asyncio.sleep(max(self.flush_interval_s, 0.5))

    async def _renew_loop(self) -> None:
        # a claim must outlive the longest call: renew what this worker holds
        while True:
            await asyncio.sleep(self.lease_s / 3)
            ids = [cid for m in self.runs.values() for cid in m.call_ids.values()]
            if ids:
                try:
                    await self._db(self.store.renew_lease, self.worker, ids,
                                            self.lease_s)
                except Exception:
                    log.exception("renewing call leases failed")

