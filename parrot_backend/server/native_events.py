"""Native API, events: a run's event log as SSE, resumable with `Last-Event-ID`.

The stream reads the store's log, not the manager's memory, so it carries exactly what
is committed. The SSE id is the event's `seq` in the store: per run, gap-free, strictly
increasing, assigned in the committing transaction from a counter in the run's row. A
seq is therefore never handed out twice, across crashes and restarts included (events
lost with a crash were never committed, so never streamed and never numbered), and no
epoch is needed in the id. A client reconnecting with `Last-Event-ID: N` gets the events
after N: none lost, none repeated. The stream ends after `run_finished`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query
from sse_starlette import EventSourceResponse
from sse_starlette.event import ServerSentEvent

from parrot_backend.store import EventRecord

from .errors import APIError
from .native_api import RuntimeDep, TenantDep, owned
from .native_schemas import SQL_INT_MAX, RunIdPath
from .runtime import NativeRuntime
from .state import StateDep

router = APIRouter(prefix="/v1", tags=["native"])
log = logging.getLogger(__name__)

POLL_S = 1.0  # re-read the log at least this often (events from another process)
BATCH = 500

_DOC = {200: {"content": {"text/event-stream": {}},
              "description": "SSE: `id: <seq>`, `event: <type>`, `data: <json payload>`"}}


def parse_last_id(value: str | None) -> int:
    """The seq after which to resume; 400 for an id this server never sent."""
    if value is None or value.strip() == "":
        return 0
    try:
        seq = int(value.strip())
    except ValueError:
        seq = -1
    if not 0 <= seq <= SQL_INT_MAX:  # beyond SQL's integers no event id exists
        raise APIError(400, f"Last-Event-ID must be an event id (a seq >= 0), got {value!r}",
                       param="Last-Event-ID")
    return seq


def frame(event: EventRecord) -> ServerSentEvent:
    data = json.dumps(event.payload, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(data=data, event=event.type, id=str(event.seq))


async def follow(rt: NativeRuntime, tenant_id: int, run_id: str,
                 after: int) -> AsyncIterator[ServerSentEvent]:
    """Events after `after`, then live ones until the run finishes."""
    store = rt.store
    rt.notifier.attach(run_id)
    try:
        while True:
            changed = rt.notifier.watch(run_id)  # before the read: no commit slips by
            events = await asyncio.to_thread(store.read_events, tenant_id, run_id, after,
                                             BATCH)
            for event in events:
                after = event.seq
                yield frame(event)
                if event.type == "run_finished":
                    return
            if len(events) == BATCH:
                continue
            if not events:
                detail = await asyncio.to_thread(store.get_run, tenant_id, run_id)
                if detail.run.finished_at is not None and detail.run.status in (
                        "done", "failed", "cancelled"):
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


@router.get("/runs/{run_id}/events", responses=_DOC)
async def run_events(
    run_id: RunIdPath, rt: RuntimeDep, tenant: TenantDep, state: StateDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    after: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX,
                                       description="same as Last-Event-ID")] = None,
) -> EventSourceResponse:
    """The run's events (`run_created`, `objectives`, `call_started`, `token`,
    `variable_ready`, `call_finished`, `run_finished`, ...) as SSE. Reconnect with
    `Last-Event-ID` to get exactly the events missed."""
    await owned(rt, tenant, run_id)
    start = after if after is not None else parse_last_id(last_event_id)
    tenant_id = await rt.tenant_id(tenant)
    settings = state.settings
    return EventSourceResponse(
        follow(rt, tenant_id, run_id, start),
        ping=settings.sse_ping_s,
        send_timeout=settings.sse_send_timeout_s,
        headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"},
    )
