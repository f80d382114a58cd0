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

import logging
from typing import Annotated

from fastapi import APIRouter, Header, Query
from sse_starlette import EventSourceResponse

from .errors import APIError
from .event_stream import event_response
from .native_api import RuntimeDep, TenantDep, owned
from .native_schemas import SQL_INT_MAX, RunIdPath
from .state import StateDep

router = APIRouter(prefix="/v1", tags=["native"])
log = logging.getLogger(__name__)

_DOC = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "SSE: `id: <seq>`, `event: <type>`, `data: <json payload>`",
    }
}


def parse_last_id(value: str | None) -> int:
    """The seq after which to resume; 400 for an id this server never sent."""
    if value is None or value.strip() == "":
        return 0
    try:
        seq = int(value.strip())
    except ValueError:
        seq = -1
    if not 0 <= seq <= SQL_INT_MAX:  # beyond SQL's integers no event id exists
        raise APIError(
            400,
            f"Last-Event-ID must be an event id (a seq >= 0), got {value!r}",
            param="Last-Event-ID",
        )
    return seq


@router.get("/runs/{run_id}/events", responses=_DOC)
async def run_events(
    run_id: RunIdPath,
    rt: RuntimeDep,
    tenant: TenantDep,
    state: StateDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    after: Annotated[
        int | None, Query(ge=0, le=SQL_INT_MAX, description="same as Last-Event-ID")
    ] = None,
) -> EventSourceResponse:
    """The run's events (`run_created`, `objectives`, `call_started`, `token`,
    `variable_ready`, `call_finished`, `run_finished`, ...) as SSE. Reconnect with
    `Last-Event-ID` to get exactly the events missed."""
    await owned(rt, tenant, run_id)
    # a browser's own reconnect resends the URL's `after` with a newer Last-Event-ID: the
    # larger one is where the client is
    start = max(after or 0, parse_last_id(last_event_id))
    tenant_id = await rt.tenant_id(tenant)
    return event_response(rt, state, tenant_id, run_id, start)
