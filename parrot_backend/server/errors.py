"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure leaves the server as one of these JSON bodies: client mistakes as 4xx with a
message naming the problem, our own bugs as a 500 that says nothing about internals.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineError,
    InvalidRequest,
    OutOfMemory,
    RequestCancelled,
)

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error meant for the client, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_engine_error(exc: EngineError) -> APIError:
    """Map the engine's per-request errors to HTTP; only request mistakes become 4xx."""
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc))
    if isinstance(exc, OutOfMemory):
        # The engine raises it only when the request cannot fit even alone: retrying won't help.
        return APIError(400, f"request does not fit in the KV cache: {exc}", code="kv_cache_full")
    if isinstance(exc, RequestCancelled):
        return APIError(
            503, "the request was cancelled by the server", headers={"Retry-After": "1"}
        )
    if isinstance(exc, (ContextNotFound, ContextBusy)):
        log.error("engine context error (a server bug): %s", exc)
        return APIError(500, "internal error while scheduling the request", type="server_error")
    # Anything else: the engine is stopped or its loop died. 503 tells clients and load
    # balancers to retry elsewhere or later; the details stay in the log.
    log.error("engine unavailable: %r", exc)
    return APIError(
        503,
        "the engine is unavailable; retry later",
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


def _format_loc(loc: tuple) -> str:
    # FastAPI prefixes body fields with "body"; clients know the field, not our plumbing.
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending parameter. Never echoes the input value,
    which may be NaN (not JSON-encodable) or huge."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    messages = []
    for err in errors[:5]:
        where = _format_loc(tuple(err.get("loc", ())))
        if err.get("type") == "missing" and not where:
            messages.append("a JSON object body is required")
            continue
        messages.append(f"{where or 'request body'}: {err.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    param = _format_loc(tuple(first.get("loc", ()))) or None
    return "; ".join(messages) + more, param


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return from_engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return APIError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", type="server_error").response()
