"""A run's committed event log as an SSE response (the events route, and runs created
with `?stream=true`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse
from sse_starlette.event import ServerSentEvent

from parrot_backend.store import EventRecord

from .runtime import NativeRuntime
from .state import ServerState

log = logging.getLogger(__name__)

POLL_S = 1.0  # re-read the log at least this often (events from another process)
BATCH = 500


def frame(event: EventRecord) -> ServerSentEvent:
    data = json.dumps(event.payload, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=data, event=event.type, id=str(event.seq))


def frames(events: list[EventRecord]) -> tuple[bytes, bool]:
    """The events, up to and including a `run_finished`, as one chunk of SSE frames, and
    whether the run finished. One chunk per read of the log: a flush commits a step's
    tokens of every call at once, and sending them as one write instead of one per event
    takes most of the stream's work off the event loop (which shares the CPU with the
    engine's steps on a CPU server)."""
    out = []
    for event in events:
        out.append(frame(event).encode())
        if event.type == "run_finished":
            return b"".join(out), True
    return b"".join(out), False


async def follow(
    rt: NativeRuntime, tenant_id: int, run_id: str, after: int
) -> AsyncIterator[ServerSentEvent]:
    """Events after `after`, then live ones until the run finishes."""
    store = rt.store
    rt.notifier.attach(run_id)
    try:
        while True:
            changed = rt.notifier.watch(run_id)  # before the read: no commit slips by
            events = await asyncio.to_thread(store.read_events, tenant_id, run_id, after, BATCH)
            if events:
                chunk, finished = frames(events)
                yield chunk
                if finished:
                    return
                after = events[-1].seq
            if len(events) == BATCH:
                continue
            if not events:
                detail = await asyncio.to_thread(store.get_run, tenant_id, run_id)
                if detail.run.finished_at is not None and detail.run.status in (
                    "done",
                    "failed",
                    "cancelled",
                ):
                    # finished before we looked; its run_finished was sent or pruned
                    if await asyncio.to_thread(store.last_event_seq, run_id) <= after:
                        return
                    continue
            await rt.notifier.wait(changed, POLL_S)
    except Exception:
        log.exception("event stream of run %s failed", run_id)
        raise
    finally:
        # runs on the end, on client disconnect (CancelledError) and on send timeouts
        rt.notifier.detach(run_id)


def event_response(
    rt: NativeRuntime,
    state: ServerState,
    tenant_id: int,
    run_id: str,
    after: int,
    *,
    status_code: int = 200,
) -> EventSourceResponse:
    """The run's events after `after` as SSE, until `run_finished`; the run id travels in
    the `X-Parrot-Run-Id` header (a stream that creates the run names it there)."""
    settings = state.settings
    return EventSourceResponse(
        follow(rt, tenant_id, run_id, after),
        status_code=status_code,
        ping=settings.sse_ping_s,
        send_timeout=settings.sse_send_timeout_s,
        headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache", "X-Parrot-Run-Id": run_id},
    )
