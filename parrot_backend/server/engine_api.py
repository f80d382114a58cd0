"""The engine process's HTTP API: `fill`, `generate`, `free`, `stats` for a remote manager.

`create_engine_app(engine, api_key=...)` serves one in-process `Engine` (anything with its
attributes) to `parrot_backend.engines.remote.RemoteEngine`. Every route except `/healthz`
needs `Authorization: Bearer <api_key>`, the docs and the OpenAPI schema included: this
API runs arbitrary prompts and frees anyone's contexts, so it is never open (vLLM's API key
left most of its routes open). There is no way to turn the key off.

The wire format (request and response models, error mapping, server-sent-event framing)
is `parrot_backend.contract.wire`, which the client side speaks too. A client that
disconnects (closes the stream or abandons a fill) cancels the engine request at its next
step: the context keeps what was computed or generated so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ..contract.engine import EngineStats, ScoredFill
from ..contract.errors import ContextBusy, ContextNotFound, EngineError
from ..contract.wire import (
    HEALTH_PATH,
    EngineInfo,
    ErrorResponse,
    FillRequest,
    FillResponse,
    FreeRequest,
    GenerateRequest,
    OkResponse,
    ResetResponse,
    TokenizerFiles,
    delta_frame,
    error_body,
    error_frame,
    error_payload,
)
from .sse import ClosingEventSourceResponse

log = logging.getLogger(__name__)
T = TypeVar("T")

PING_S = 15.0
SEND_TIMEOUT_S = 60.0  # a manager that stops reading its stream is dropped after this


def error_response(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(type_, message), status_code=status)


# ---------------------------------------------------------------- auth
class EngineKeyMiddleware:
    """Every path but /healthz needs the engine's key; unknown paths too (fail closed)."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        # Compare digests in constant time so the check leaks nothing about the key.
        given = hashlib.sha256(key.strip().encode("utf-8", "surrogatepass")).digest()
        if scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if not header else "invalid API key"
        response = error_response(
            401, "Unauthorized", f"{message}: send 'Authorization: Bearer <engine key>'"
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="parrot-engine"'
        await response(scope, receive, send)


# ---------------------------------------------------------------- helpers
async def _race_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Await `work`, cancelling it when the client goes away (a manager that cancelled its
    fill or generate closes the connection; the engine must stop working for it).
    Returns (disconnected, result)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the engine call sees CancelledError and cancels its request
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return True, None
    return False, task.result()


def _tokenizer_files(tokenizer) -> TokenizerFiles:
    with tempfile.TemporaryDirectory(prefix="parrot-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_text("utf-8") for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    digest = hashlib.sha256()
    for name, text in files.items():
        digest.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return TokenizerFiles(fingerprint=digest.hexdigest(), files=files)


# ---------------------------------------------------------------- the app
def create_engine_app(engine, *, api_key: str, manage_engine: bool = False) -> FastAPI:
    """The engine API around `engine` (an in-process `Engine`: it needs `tokenizer`,
    `vocab_size`, `max_model_len`, `pool.block_size` besides the primitives). With
    `manage_engine` the app's lifespan starts and stops the engine. Raises ValueError
    without a key: an open engine API would let anyone run and free contexts."""
    if not api_key or not api_key.strip():
        raise ValueError("the engine API needs an API key (it is never served open)")
    tokenizer = _tokenizer_files(engine.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.stop()

    app = FastAPI(
        title="parrot-backend engine",
        version="0.1.0",
        lifespan=lifespan,
        summary="fill / generate / free / stats on one engine (for a manager)",
    )
    app.state.engine = engine

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        status, name = error_payload(exc)
        if status == 503:
            log.warning("engine request failed: %r", exc)
        return error_response(status, name, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {err.get('msg', 'invalid value')}")
        return error_response(400, "InvalidRequest", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, "HTTPError", detail)

    @app.get(HEALTH_PATH, include_in_schema=False)
    async def healthz() -> JSONResponse:
        error = getattr(engine, "error", None)
        if error is not None:  # the engine loop died: the process is about to exit
            return JSONResponse({"status": "failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/engine/info", response_model=EngineInfo)
    async def info() -> EngineInfo:
        return EngineInfo(
            model_name=engine.model_name,
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            block_size=engine.pool.block_size,
            chat_template=getattr(engine, "chat_template", None),
            special_tokens=dict(getattr(engine, "special_tokens", None) or {}),
            eos_token_ids=sorted(getattr(engine, "eos_ids", ()) or ()),
            tokenizer_fingerprint=tokenizer.fingerprint,
        )

    @app.get("/engine/tokenizer", response_model=TokenizerFiles)
    async def tokenizer_files() -> TokenizerFiles:
        return tokenizer

    @app.get("/engine/stats", response_model=EngineStats)
    async def stats() -> dict[str, Any]:
        return dataclasses.asdict(await engine.stats())

    @app.post(
        "/engine/fill",
        response_model=FillResponse,
        response_model_exclude_none=True,  # `prompt_logprobs` only when asked
        responses={
            400: {"model": ErrorResponse},
            404: {"model": ErrorResponse},
            409: {"model": ErrorResponse},
            507: {"model": ErrorResponse},
        },
    )
    async def fill(body: FillRequest, request: Request) -> FillResponse | JSONResponse:
        # (the keyword only when asked: an engine that does not score takes no such keyword)
        scoring = {} if body.prompt_logprobs is None else {"prompt_logprobs": body.prompt_logprobs}
        gone, result = await _race_disconnect(
            request,
            engine.fill(
                body.context_id,
                body.parent_id,
                body.token_ids,
                salt=body.salt,
                priority=body.priority,
                **scoring,
            ),
        )
        if gone:  # nobody reads this; the fill was cancelled
            return error_response(503, "RequestCancelled", "client disconnected")
        if isinstance(result, ScoredFill):
            return FillResponse(length=result.length, prompt_logprobs=result.prompt_logprobs)
        return FillResponse(length=result)

    @app.post(
        "/engine/generate",
        response_model=None,
        responses={
            200: {
                "description": "server-sent events, one TokenDelta each",
                "content": {"text/event-stream": {}},
            },
            400: {"model": ErrorResponse},
            404: {"model": ErrorResponse},
            409: {"model": ErrorResponse},
            507: {"model": ErrorResponse},
        },
    )
    async def generate(body: GenerateRequest, request: Request):
        deltas = engine.generate(
            body.context_id, body.parent_id, body.sampling, salt=body.salt, priority=body.priority
        )
        # Wait for the first delta before answering, so request errors get a status code.
        try:
            gone, first = await _race_disconnect(request, anext(deltas))
        except StopAsyncIteration:
            return error_response(503, "EngineError", "generation ended without a token")
        if gone:
            return error_response(503, "RequestCancelled", "client disconnected")

        async def events() -> AsyncIterator[bytes]:
            delta = first
            try:
                while True:
                    yield delta_frame(delta)
                    if delta.finish_reason is not None:
                        return
                    delta = await anext(deltas)
            except EngineError as exc:
                yield error_frame(exc)

        # on_close runs even when the client left before the first frame was sent: closing
        # the engine's iterator is what cancels the generation.
        return ClosingEventSourceResponse(
            events(), on_close=deltas.aclose, ping_s=PING_S, send_timeout_s=SEND_TIMEOUT_S
        )

    @app.post(
        "/engine/free",
        response_model=OkResponse,
        responses={404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}},
    )
    async def free(body: FreeRequest) -> OkResponse:
        await engine.free(body.context_id)
        return OkResponse()

    @app.post("/engine/reset", response_model=ResetResponse)
    async def reset() -> ResetResponse:
        """Free every idle context. A manager that (re-)registers this engine knows none of
        its contexts: whatever a previous manager left (its kept prefixes) is orphaned KV,
        and its deterministic prefix ids would otherwise be appended to, not created."""
        freed = 0
        progress = True
        while progress:  # children before parents: a parent frees once its children went
            progress = False
            for cid in list(engine.contexts):
                try:
                    await engine.free(cid)
                except (ContextBusy, ContextNotFound):
                    continue
                freed += 1
                progress = True
        return ResetResponse(freed=freed, left=len(engine.contexts))

    app.add_middleware(EngineKeyMiddleware, api_key=api_key)
    return app
