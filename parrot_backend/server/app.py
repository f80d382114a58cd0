"""`create_app`: the FastAPI application around one engine."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI

from ..contract.engine import EngineClient
from . import openai_api, ops, tokenize_api
from .auth import OPEN_PATHS, Authenticator, AuthMiddleware
from .errors import install_error_handlers
from .limits import BodyLimitMiddleware, InflightLimiter, check_backlog
from .metrics import ServerMetrics
from .settings import ServerSettings
from .state import ServerState

if TYPE_CHECKING:
    from .engine_registry import EngineRegistry
    from .runtime import NativeRuntime

log = logging.getLogger(__name__)


def create_app(
    engine: EngineClient,
    *,
    settings: ServerSettings | None = None,
    native: NativeRuntime | None = None,
    registry: EngineRegistry | None = None,
) -> FastAPI:
    """Build the app. With `settings.manage_engine` the lifespan starts and stops the engine;
    otherwise the caller owns it. With `native` (store + manager, `runtime.py`) the native
    API is served too, and the lifespan starts it (resuming unfinished runs) after the
    engine and stops it before. Raises ValueError for unsafe settings (auth off on a
    non-loopback host)."""
    settings = settings or ServerSettings()
    settings.check()
    metrics = ServerMetrics()
    authenticator = Authenticator(settings)
    state = ServerState(
        engine=engine,
        settings=settings,
        metrics=metrics,
        limiter=InflightLimiter(
            settings.max_inflight, settings.retry_after_s, settings.max_inflight_per_tenant
        ),
        authenticator=authenticator,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.manage_engine:
            await engine.start()
        try:
            if native is not None:
                await native.start()
            if registry is not None:
                await registry.start()
            try:
                yield
            finally:
                if registry is not None:
                    await registry.stop()
                if native is not None:
                    await native.stop()
        finally:
            if settings.manage_engine:
                await engine.stop()

    app = FastAPI(
        title="parrot-backend",
        summary="Application-aware LLM serving (Parrot): native runs of programs with "
        "semantic variables, and an OpenAI-compatible API",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.parrot = state
    install_error_handlers(app)
    app.include_router(ops.router)
    app.include_router(openai_api.router)
    app.include_router(tokenize_api.router)
    if native is not None:
        from . import native_api, native_events, native_workflows

        app.state.native = native
        metrics.watch_manager(native.manager)
        backlog = [Depends(check_backlog)]  # 429 while too many calls wait for engines
        app.include_router(native_api.router, dependencies=backlog)
        app.include_router(native_events.router)
        app.include_router(native_workflows.router, dependencies=backlog)
        from . import ui  # the web page at /ui (`/` redirects there) and its events grants

        app.include_router(ui.router)
        ui.mount_static(app)
    if registry is not None:  # remote engines register here (operator key)
        app.include_router(registry.router)
    # Added last = outermost: auth first (cheap, rejects strangers before we buffer their
    # bodies), then the body limit, then FastAPI.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_body_bytes, on_reject=metrics.reject
    )
    app.add_middleware(AuthMiddleware, authenticator=authenticator, on_reject=metrics.reject)
    _document_errors(app, auth=settings.auth_enabled)
    if settings.auth_enabled:
        _document_bearer_auth(app)
    else:
        log.warning("API authentication is off (loopback only: %s)", settings.host)
    return app


# What any operation may answer besides its success: bad input, no such run or variable,
# a state conflict (a closed run, an input set twice), a body over the limit, a tenant or
# server over its backlog, no engine to serve; 401 with auth on.
_ERROR_STATUSES = {
    "400": "Bad input: the message names the problem (and `param`, where there is one)",
    "404": "Not found (a run, variable, workflow or model)",
    "409": "Conflict with the state (a closed or cancelled run, an input set twice)",
    "413": "Request body too large",
    "429": "Too many requests waiting (retry after `Retry-After` seconds)",
    "503": "No engine can serve the request now",
}


def _document_errors(app: FastAPI, *, auth: bool) -> None:
    """Document the error answers the server gives, in the OpenAI error shape, in place of
    FastAPI's 422 (it never sends one: validation errors are 400s): generated clients and
    schema-driven tests then know every status an operation may return."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["ErrorResponse"] = {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                }
            },
        }
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        statuses = dict(_ERROR_STATUSES)
        if auth:
            statuses["401"] = "Missing or unknown API key"
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status, text in statuses.items():
                    responses.setdefault(status, {"description": text, "content": ref})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the middleware's Bearer auth in the OpenAPI schema, so /docs can send keys
    and generated clients know which operations need one."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
            "type": "http",
            "scheme": "bearer",
        }
        for path, operations in schema.get("paths", {}).items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearerAuth": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
