"""Request size and concurrency limits: the server says 413/429 instead of falling over."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_body


class BodyLimitMiddleware:
    """Buffers each request body up to `max_bytes` and answers 413 beyond it.

    Buffering here (rather than counting inside the route) means the 413 is decided before
    FastAPI parses anything, whatever the Content-Length claims or a chunked body carries.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, on_reject=None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending; nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject("body_too_large")
        body = json.dumps(
            error_body(
                f"request body too large: the limit is {self.max_bytes} bytes "
                "(the server's max_body_bytes; `parrot-backend serve --max-body-bytes`)",
                "invalid_request_error",
                None,
                "body_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class InflightLimiter:
    """Bounds the generating requests; beyond the bound a request gets 429 + Retry-After.

    Rejecting at once (instead of queueing) keeps memory bounded and tells load balancers
    and clients to back off while the engine is saturated. With `per_tenant`, one tenant
    (API key's tenant) holds at most that many of the slots, so a tenant's burst (one
    batch of 64 prompts, say) cannot take the whole server from the others.
    """

    def __init__(self, limit: int, retry_after_s: int, per_tenant: int | None = None) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.per_tenant = per_tenant
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}  # tenants with slots held (none: no entry)

    def acquire(self, tenant: str | None = None) -> Slot:
        return self.acquire_many(1, tenant)[0]

    def acquire_many(self, count: int, tenant: str | None = None) -> list[Slot]:
        """`count` slots at once or none (429): a batch of prompts takes one per prompt, all
        before any work starts, so it never waits on slots it holds itself nor gets part of
        the engine past the bound. A batch larger than a bound could never be admitted:
        the route refuses it first (400, `max_prompts`)."""
        batch = f"; this request needs {count}" if count > 1 else ""
        if self.inflight + count > self.limit:
            raise self._busy(
                f"server busy: {self.inflight} requests in flight (limit {self.limit}{batch})"
            )
        held = self.by_tenant.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and self.per_tenant is not None and held + count > self.per_tenant:
            raise self._busy(
                f"too many requests in flight for this API key's tenant: {held} (limit "
                f"{self.per_tenant} per tenant{batch})"
            )
        self.inflight += count
        if tenant is not None:
            self.by_tenant[tenant] = held + count
        return [Slot(self, tenant) for _ in range(count)]

    def _busy(self, why: str) -> APIError:
        return APIError(
            429,
            f"{why}; retry later",
            code="server_overloaded",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def _release(self, tenant: str | None) -> None:
        self.inflight -= 1
        if tenant is not None:
            left = self.by_tenant.get(tenant, 1) - 1
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)


class Slot:
    """One admitted request; `release()` is idempotent so every exit path may call it."""

    __slots__ = ("_limiter", "_tenant")

    def __init__(self, limiter: InflightLimiter, tenant: str | None = None) -> None:
        self._limiter: InflightLimiter | None = limiter
        self._tenant = tenant

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter._release(self._tenant)
            self._limiter = None


def _starts_work(method: str, path: str) -> bool:
    """Native requests that add calls to the manager's queue."""
    if method != "POST":
        return False
    return (
        path == "/v1/runs"
        or path.endswith("/calls")
        or path.endswith("/replay")
        or (path.startswith("/v1/workflows/") and path.endswith("/runs"))
    )


def check_backlog(request: Request) -> None:
    """FastAPI dependency for the native routers: 429 + Retry-After while the manager has
    `max_pending_calls` ready calls waiting for an engine, so a burst of runs cannot grow
    the queue (and memory) without bound."""
    if not _starts_work(request.method, request.url.path):
        return
    settings = request.app.state.parrot.settings
    pending = request.app.state.native.manager.counts()["pending_calls"]
    if pending >= settings.max_pending_calls:
        raise APIError(
            429,
            f"server busy: {pending} calls wait for an engine (limit "
            f"{settings.max_pending_calls}); retry later",
            code="server_overloaded",
            headers={"Retry-After": str(settings.retry_after_s)},
        )
