"""Manager side of remote engines: registration, heartbeats, expiry.

An engine process (`parrot-backend engine --manager URL`) calls
`POST /v1/engines/register` with its id, URL, model and engine API key, then
`POST /v1/engines/{id}/heartbeat` every `heartbeat_interval_s`. The registry connects a
`RemoteEngine` to it (fetching its info and tokenizer) and calls `on_added(id, client)`;
an engine that misses `max_missed` heartbeats in a row, or deregisters
(`DELETE /v1/engines/{id}`), or registers again under the same id (a restart: its
contexts are gone) is dropped: `on_removed(id)` is called, then its client is closed.
Callbacks may be plain functions or coroutines.

Both routes need the **operator key** as `Authorization: Bearer <key>`; tenant keys are
refused. A registering engine is reset (its idle contexts freed) before `on_added`.
Wiring into the server app (which checks tenant keys in its middleware first):

    registry = EngineRegistry(operator_key=op_key, model_name=manager.model,
                              on_added=..., on_removed=...)
    app.include_router(registry.router)
    # the app's AuthMiddleware must let the operator key through: either list it as a
    # key (ServerSettings(api_keys={..., op_key: "operator"})) or exempt "/v1/engines/"
    # there; this router checks the operator key itself in both cases.
    # lifespan: await registry.start() after the manager starts; await registry.stop()
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..contract.errors import EngineError
from ..engines.remote import RemoteEngine

log = logging.getLogger(__name__)

OnAdded = Callable[[str, RemoteEngine], "Awaitable[None] | None"]
OnRemoved = Callable[[str], "Awaitable[None] | None"]
Connector = Callable[..., Awaitable[RemoteEngine]]


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")
    url: str = Field(
        min_length=1, max_length=2000, description="base URL the manager reaches the engine API at"
    )
    model_name: str = Field(min_length=1, max_length=500)
    api_key: str = Field(min_length=1, max_length=1000, description="the engine API's key")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"url is not a valid URL: {exc}") from None
        if not parsed.host:
            raise ValueError("url has no host")
        if parsed.port is not None and not 0 < parsed.port < 65536:
            raise ValueError(f"url's port {parsed.port} is not a TCP port (1-65535)")
        return url.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _header_safe(cls, key: str) -> str:
        # it is sent as a header: printable ASCII only (an "é" failed the connect with a 500)
        if not (key.isascii() and key.isprintable()):
            raise ValueError("api_key must be printable ASCII (it is sent in a header)")
        return key


class RegisterResponse(BaseModel):
    engine_id: str
    heartbeat_interval_s: float
    max_missed: int


class HeartbeatResponse(BaseModel):
    ok: bool = True


class EngineEntry(BaseModel):
    engine_id: str
    url: str
    model_name: str
    seconds_since_heartbeat: float


@dataclass(slots=True)
class _Engine:
    client: RemoteEngine
    url: str
    last_seen: float


async def _call(callback: Callable[..., Any] | None, *args: Any) -> None:
    if callback is None:
        return
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class EngineRegistry:
    """Remote engines by id, kept alive by heartbeats. Use `router` in the app and run
    `start()`/`stop()` on the serving loop (the expiry task)."""

    def __init__(
        self,
        *,
        operator_key: str,
        model_name: str | None = None,
        heartbeat_interval_s: float = 2.0,
        max_missed: int = 3,
        on_added: OnAdded | None = None,
        on_removed: OnRemoved | None = None,
        connect: Connector = RemoteEngine.connect,
        clock: Callable[[], float] = time.monotonic,
        reset_on_register: bool = True,
    ) -> None:
        """`model_name`: refuse engines serving another model (one manager, one model).
        `connect(url, api_key=...)` builds the client (tests may swap it).
        `reset_on_register`: free every idle context of a (re-)registering engine: the
        manager knows none of them (it restarted, or expired the engine and failed its
        calls over), so they are orphans, and the manager's content-derived prefix ids
        would append to them instead of creating fresh contexts."""
        if not operator_key or not operator_key.strip():
            raise ValueError("the engine registry needs an operator key")
        if heartbeat_interval_s <= 0 or max_missed < 1:
            raise ValueError("heartbeat_interval_s must be > 0 and max_missed >= 1")
        self._key_digest = hashlib.sha256(operator_key.encode()).digest()
        self.model_name = model_name
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_missed = max_missed
        self.on_added = on_added
        self.on_removed = on_removed
        self._connect = connect
        self._clock = clock
        self.reset_on_register = reset_on_register
        self._engines: dict[str, _Engine] = {}
        self._lock = asyncio.Lock()  # one registration/removal at a time keeps callbacks ordered
        self._task: asyncio.Task[None] | None = None
        self.router = self._make_router()

    # ------------------------------------------------------------------ queries
    @property
    def engines(self) -> dict[str, RemoteEngine]:
        """The live engines by id (a copy)."""
        return {eid: e.client for eid, e in self._engines.items()}

    def get(self, engine_id: str) -> RemoteEngine | None:
        entry = self._engines.get(engine_id)
        return entry.client if entry else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the expiry task on the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._expire_loop(), name="engine-registry-expiry")

    async def stop(self) -> None:
        """Stop expiring and close every client, without calling `on_removed` (the
        manager is shutting down too)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        async with self._lock:
            entries, self._engines = list(self._engines.values()), {}
        for entry in entries:
            await entry.client.aclose()

    # ------------------------------------------------------------------ operations
    async def register(self, req: RegisterRequest) -> RegisterResponse:
        """Connect to the engine and add it; a known id is replaced (it restarted)."""
        if self.model_name is not None and req.model_name != self.model_name:
            raise HTTPException(
                409, f"this manager serves {self.model_name!r}, not {req.model_name!r}"
            )
        try:
            client = await self._connect(req.url, api_key=req.api_key)
        except (EngineError, httpx.HTTPError, ValueError, OverflowError) as exc:
            # (httpx and the socket layer raise the last three for URLs and keys they refuse)
            raise HTTPException(400, f"cannot use the engine at {req.url}: {exc}") from exc
        if client.model_name != req.model_name:
            await client.aclose()
            raise HTTPException(
                400,
                f"the engine at {req.url} serves {client.model_name!r}, "
                f"not {req.model_name!r} as registered",
            )
        if self.reset_on_register:
            try:
                freed = await client.reset()
            except EngineError as exc:
                await client.aclose()
                raise HTTPException(400, f"cannot reset the engine at {req.url}: {exc}") from exc
            if freed:
                log.info(
                    "engine %s: freed %d contexts left by a previous manager", req.engine_id, freed
                )
        async with self._lock:
            if req.engine_id in self._engines:
                log.info("engine %s registered again (restarted); replacing it", req.engine_id)
                await self._remove_locked(req.engine_id)
            self._engines[req.engine_id] = _Engine(client, req.url, self._clock())
            try:
                await _call(self.on_added, req.engine_id, client)
            except Exception as exc:
                del self._engines[req.engine_id]
                await client.aclose()
                log.exception("on_added failed for engine %s", req.engine_id)
                raise HTTPException(503, f"the manager could not add the engine: {exc}") from exc
        log.info("engine %s registered at %s", req.engine_id, req.url)
        return RegisterResponse(
            engine_id=req.engine_id,
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_missed=self.max_missed,
        )

    def heartbeat(self, engine_id: str) -> bool:
        """Record a heartbeat; False for an unknown id (the engine must register again)."""
        entry = self._engines.get(engine_id)
        if entry is None:
            return False
        entry.last_seen = self._clock()
        return True

    async def remove(self, engine_id: str) -> bool:
        """Drop an engine: `on_removed`, then close its client. False if unknown."""
        async with self._lock:
            return await self._remove_locked(engine_id)

    async def _remove_locked(self, engine_id: str) -> bool:
        entry = self._engines.pop(engine_id, None)
        if entry is None:
            return False
        try:
            await _call(self.on_removed, engine_id)
        except Exception:  # the engine is gone either way; keep expiring the others
            log.exception("on_removed failed for engine %s", engine_id)
        finally:
            await entry.client.aclose()
        return True

    async def expire(self) -> list[str]:
        """Remove engines whose last heartbeat is older than `max_missed` intervals."""
        limit = self.heartbeat_interval_s * self.max_missed
        now = self._clock()
        stale = [eid for eid, e in self._engines.items() if now - e.last_seen > limit]
        removed = []
        for eid in stale:
            entry = self._engines.get(eid)
            # a heartbeat may have arrived while we removed another one
            if entry is not None and self._clock() - entry.last_seen > limit:
                log.warning("engine %s missed %d heartbeats; removing it", eid, self.max_missed)
                if await self.remove(eid):
                    removed.append(eid)
        return removed

    async def _expire_loop(self) -> None:
        # Check a few times per interval so removal lands soon after the limit passes.
        period = self.heartbeat_interval_s / 2
        while True:
            await asyncio.sleep(period)
            try:
                await self.expire()
            except Exception:  # never let one bad round stop expiry for good
                log.exception("engine expiry round failed")

    # ------------------------------------------------------------------ HTTP
    def _check_operator(self, request: Request) -> None:
        header = request.headers.get("authorization") or ""
        scheme, _, key = header.partition(" ")
        given = hashlib.sha256(key.strip().encode("utf-8", "surrogatepass")).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._key_digest):
            raise HTTPException(
                401 if not header else 403,
                "engine registration needs the operator key",
                headers={"WWW-Authenticate": 'Bearer realm="parrot-operator"'},
            )

    def _make_router(self) -> APIRouter:
        router = APIRouter(
            prefix="/v1/engines", tags=["engines"], dependencies=[Depends(self._check_operator)]
        )

        @router.post("/register", response_model=RegisterResponse)
        async def register(body: RegisterRequest) -> RegisterResponse:
            return await self.register(body)

        @router.post("/{engine_id}/heartbeat", response_model=HeartbeatResponse)
        async def heartbeat(engine_id: str) -> HeartbeatResponse:
            if not self.heartbeat(engine_id):
                raise HTTPException(404, f"unknown engine {engine_id!r}: register again")
            return HeartbeatResponse()

        @router.delete("/{engine_id}", response_model=HeartbeatResponse)
        async def deregister(engine_id: str) -> HeartbeatResponse:
            if not await self.remove(engine_id):
                raise HTTPException(404, f"unknown engine {engine_id!r}")
            return HeartbeatResponse()

        @router.get("", response_model=list[EngineEntry])
        async def list_engines() -> list[EngineEntry]:
            now = self._clock()
            return [
                EngineEntry(
                    engine_id=eid,
                    url=e.url,
                    model_name=e.client.model_name,
                    seconds_since_heartbeat=now - e.last_seen,
                )
                for eid, e in self._engines.items()
            ]

        return router
