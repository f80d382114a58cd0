"""Write-before-acknowledge: a `RunListener` that commits every manager event to the store.

The manager awaits `on_event` before the change it reports becomes visible (to `get`,
run status, event subscribers), so whatever a client can observe is already committed.
Store calls are synchronous SQLAlchemy units of work; they run in worker threads so the
event loop (and with it the engine's scheduling) never waits on the database.

Token events are the exception that keeps the store cheap: they are buffered and written
in batches by a background flusher (every `flush_interval_s`). Nothing reads tokens from
the manager's memory: SSE streams read the store's log, so a token is streamed only once
its batch committed. Before any other event of a run is written, the run's buffered
tokens are written first (per-run lock), so the log keeps the manager's order and a
call's tokens are durable before its value or its end are acknowledged. Tokens still in
the buffer when the process dies were never streamed; the call runs again after recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from parrot_backend.program import CallSpec
from parrot_backend.store import CallRecord, Store
from parrot_backend.store.columns import utcnow

from .notify import Notifier

log = logging.getLogger(__name__)

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
    tokens: list[tuple[str, str, Any]] = field(default_factory=list)  # buffered events
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # call -> tokens
    first_token: dict[str, datetime] = field(default_factory=dict)  # not yet recorded
    first_done: set[str] = field(default_factory=set)

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
    """The store's call descriptors (name, inputs, outputs) of call specs, in order."""
    out = []
    for i, raw in enumerate(calls):
        call = CallSpec.model_validate(raw).build(first + i)
        out.append({"name": call.name, "inputs": list(call.inputs),
                    "outputs": list(call.outputs)})
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
    ) -> None:
        self.store = store
        self.worker = worker
        self.notifier = notifier
        self.flush_interval_s = flush_interval_s
        self.lease_s = lease_s
        self.runs: dict[str, RunMeta] = {}
        self.frozen = False  # set on shutdown: later events are not persisted
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

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
            meta.tokens.append((run_id, type, payload))
            call = payload["call"]
            meta.counts[call] += 1
            if call not in meta.first_done and call not in meta.first_token:
                meta.first_token[call] = utcnow()
            self._dirty.set()
            return
        async with meta.lock:
            await self._flush(run_id, meta)
            await self._write(run_id, meta, type, payload)
        self.notifier.wake(run_id)

    async def _write(self, run_id: str, meta: RunMeta, type: str, payload: dict) -> None:
        handler = getattr(self, f"_on_{type}", None)
        if handler is None:  # any other event type: just log it
            await asyncio.to_thread(self.store.append_event, run_id, type, payload)
            return
        await handler(run_id, meta, payload)

    async def _on_run_created(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        st = self.store
        if meta.resumed:
            # the rows exist; the manager re-announced the run while recovering it
            await asyncio.to_thread(st.append_event, run_id, "run_resumed", {})
            return
        program = dict(payload["program"])
        meta.program = program
        calls = _descriptors(program["calls"], 0)
        detail = await asyncio.to_thread(
            st.create_run, meta.tenant_id, program, calls, payload["inputs"],
            payload["outputs"], open=payload["open"], workflow_id=meta.workflow_id,
            replay_of=meta.replay_of, run_id=run_id, events=[("run_created", payload)])
        meta.set_calls(detail.calls)

    async def _on_calls_added(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        first = len(meta.program["calls"])
        added = _plain(payload["calls"])
        calls = _descriptors(added, first)
        program = {**meta.program, "calls": [*meta.program["calls"], *added]}
        await asyncio.to_thread(self.store.add_calls, meta.tenant_id, run_id, calls,
                                program=program, events=[("calls_added", payload)])
        meta.program = program
        await self.refresh_call_ids(run_id, meta)

    async def refresh_call_ids(self, run_id: str, meta: RunMeta) -> None:
        """Reload the call name -> store id map of a run."""
        detail = await asyncio.to_thread(self.store.get_run, meta.tenant_id, run_id)
        meta.set_calls(detail.calls)
        meta.program = dict(detail.program)

    async def _on_objectives(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        idx = meta.call_idx
        plans = {
            idx[name]: {"objective": o["objective"],
                        "task_group": None if o["group"] is None else str(o["group"])}
            for name, o in payload["calls"].items() if name in idx
        }
        st = self.store
        await asyncio.to_thread(st.annotate_calls, run_id, plans)
        await asyncio.to_thread(st.append_event, run_id, "objectives", payload)

    async def _on_run_closed(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        await asyncio.to_thread(self.store.close_run, meta.tenant_id, run_id)
        await asyncio.to_thread(self.store.append_event, run_id, "run_closed", payload)

    async def _on_call_started(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        st = self.store
        if not meta.started:
            await asyncio.to_thread(st.set_run_status, run_id, "running")
            meta.started = True
        call = payload["call"]
        meta.counts[call] = 0
        meta.first_done.discard(call)
        meta.first_token.pop(call, None)
        held = await asyncio.to_thread(
            st.hold_call, meta.call_ids[call], self.worker, engine=payload.get("engine"),
            lease_s=self.lease_s, events=[("call_started", payload)])
        if not held:  # another process runs it: this manager must not
            raise RuntimeError(f"call {call!r} of run {run_id} is held by another worker")

    async def _on_variable_ready(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        await asyncio.to_thread(self.store.set_variables, run_id,
                                {payload["name"]: payload["value"]},
                                events=[("variable_ready", payload)])

    async def _on_variable_failed(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        st = self.store
        if await asyncio.to_thread(st.fail_variable, run_id, payload["name"], payload["error"]):
            await asyncio.to_thread(st.append_event, run_id, "variable_failed", payload)

    async def _on_call_finished(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        call = payload["call"]
        result = await asyncio.to_thread(
            self.store.finish_call, meta.call_ids[call], self.worker, {},
            completion_tokens=meta.counts.get(call, 0), events=[("call_finished", payload)])
        if not result.accepted:
            log.warning("run %s: call %r finished without holding its claim", run_id, call)

    async def _on_call_failed(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        st = self.store
        call_id = meta.call_ids[payload["call"]]
        # a call failed because an input failed never ran: claim it to record the failure
        await asyncio.to_thread(st.hold_call, call_id, self.worker, start=False,
                                lease_s=self.lease_s)
        await asyncio.to_thread(st.fail_call, call_id, self.worker, payload["error"],
                                events=[("call_failed", payload)])

    async def _on_run_finished(self, run_id: str, meta: RunMeta, payload: dict) -> None:
        await asyncio.to_thread(self.store.set_run_status, run_id,
                                _RUN_STATUS[payload["status"]],
                                events=[("run_finished", payload)])

    # ------------------------------------------------------------------ tokens
    async def _flush(self, run_id: str, meta: RunMeta) -> None:
        """Write the run's buffered tokens (caller holds `meta.lock`)."""
        if not meta.tokens:
            return
        batch, meta.tokens = meta.tokens, []
        firsts, meta.first_token = meta.first_token, {}
        await asyncio.to_thread(self.store.append_events, batch)
        for call, at in firsts.items():
            meta.first_done.add(call)
            call_id = meta.call_ids.get(call)
            if call_id is not None:
                await asyncio.to_thread(self.store.mark_call_first_token, call_id,
                                        self.worker, now=at)
        self.notifier.wake(run_id)

    async def flush_all(self) -> None:
        """Write every run's buffered tokens."""
        for run_id, meta in list(self.runs.items()):
            if meta.tokens:
                async with meta.lock:
                    await self._flush(run_id, meta)

    async def _flush_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            try:
                await self.flush_all()
            except Exception:  # a failed batch stays lost; the call's end then fails too
                log.exception("writing token events failed")

    async def _renew_loop(self) -> None:
        # a claim must outlive the longest call: renew what this worker holds
        while True:
            await asyncio.sleep(self.lease_s / 3)
            ids = [cid for m in self.runs.values() for cid in m.call_ids.values()]
            if ids:
                try:
                    await asyncio.to_thread(self.store.renew_lease, self.worker, ids,
                                            self.lease_s)
                except Exception:
                    log.exception("renewing call leases failed")

