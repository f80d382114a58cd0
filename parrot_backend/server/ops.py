"""Operational routes: /healthz (open) and /metrics (behind auth like everything else)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import error_body
from .openai_schemas import Health
from .state import StateDep

router = APIRouter(tags=["ops"])


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"description": "The engine does not answer"}},
)
async def healthz(state: StateDep):
    """Liveness: the engine's loop has not died and it answers a stats call within a
    second. Says nothing else, since it is open to unauthenticated callers."""
    try:
        if getattr(state.engine, "error", None) is not None:  # the engine loop died
            raise RuntimeError("engine failed")
        with anyio.fail_after(1):
            await state.engine.stats()
    except Exception:
        return JSONResponse(
            error_body("engine unavailable", "service_unavailable_error"), status_code=503
        )
    return Health(status="ok")


@router.get(
    "/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
)
async def metrics(state: StateDep) -> Response:
    return Response(await state.metrics.render(state.engine), media_type=CONTENT_TYPE_LATEST)
