"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..contract.engine import TokenDelta
from ..contract.sampling import SamplingParams
from .errors import APIError
from .generation import BatchRun, RequestRun
from .openai_logprobs import CompletionOffsets, TokenTexts, chat_logprobs, has_logprob
from .openai_prep import (
    build_sampling,
    chat_prompt,
    check_common,
    check_max_tokens_zero,
    completion_prompts,
    logprobs_of,
    prompt_logprobs_of,
    resolve_budgets,
    resolve_max_tokens,
)
from .openai_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from .openai_stream import chat_events, chat_message, completion_events, usage_of
from .sse import ClosingEventSourceResponse
from .state import ServerState, StateDep, get_tenant

log = logging.getLogger(__name__)

T = TypeVar("T")

router = APIRouter(prefix="/v1", tags=["openai"])

_STREAM_DOC = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "JSON, or SSE `data:` chunks ending in `data: [DONE]` when `stream` is true",
    }
}


@router.get("/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[_card(state)])


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, state: StateDep) -> ModelCard:
    if model_id != state.model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
        )
    return _card(state)


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len)


async def _admit(
    state: ServerState,
    request: Request,
    prompts: list[tuple[list[int], SamplingParams | None]],
    n: int,
    endpoint: str,
    started: float,
    stream: bool,
    prompt_logprobs: int | None = None,
) -> RequestRun | BatchRun | None:
    """Take in-flight slots (429 beyond the bound) and prefill the prompts. Returns None
    when the client left during the prefill (it may wait in the engine's queue).

    One prompt is one `RequestRun`; several (a completions batch, each with its own
    sampling budget) are a `BatchRun` of one `RequestRun` per prompt, filled concurrently.
    Each prompt takes a slot, all of them at once or none (429), before any engine work.

    A stream waits for its prefill `settings.stream_start_s` at most: a prompt queued
    longer gets its response started (headers, then SSE pings) while it waits, so clients
    and proxies with read timeouts see a live stream; an error of that prefill then comes
    as the stream's error event instead of an HTTP status."""
    tenant = get_tenant(request)
    try:
        slots = state.limiter.acquire_many(len(prompts), tenant)
    except APIError:
        state.metrics.reject("overloaded")
        raise
    salt = state.salt_for(tenant)
    runs = [
        RequestRun(
            state.engine,
            prompt_ids=prompt_ids,
            sampling=sampling,
            n=n,
            salt=salt,
            metrics=state.metrics,
            endpoint=endpoint,
            slot=slot,
            started=started,
            prompt_logprobs=prompt_logprobs,
        )
        for (prompt_ids, sampling), slot in zip(prompts, slots, strict=True)
    ]
    run = runs[0] if len(runs) == 1 else BatchRun(runs, n)
    try:
        wait_s = state.settings.stream_start_s if stream else None
        disconnected, _ = await until_disconnect(request, lambda: run.start(wait_s))
    except BaseException:
        await run.close()
        raise
    if disconnected:
        await run.close()
        return None
    return run


async def until_disconnect(
    request: Request, fn: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Await `fn()` but cancel it as soon as the client disconnects.

    Returns (disconnected, result). Cancelling the engine call is what stops the work;
    the caller's RequestRun.close() then frees the contexts.
    """
    result: T | None = None
    error: Exception | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:  # re-raised below, outside the task group's wrapping
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return disconnected, result


async def _collect(
    run: RequestRun | BatchRun, request: Request
) -> tuple[list[str], list[list[TokenDelta]]] | None:
    """Run every choice to the end: each one's text, and its deltas that carry log
    probabilities (none unless asked); None when the client disconnected first."""
    texts: list[list[str]] = [[] for _ in range(run.n)]
    scored: list[list[TokenDelta]] = [[] for _ in range(run.n)]

    async def drain() -> None:
        async for index, delta in run:
            texts[index].append(delta.text)
            if has_logprob(delta):
                scored[index].append(delta)

    disconnected, _ = await until_disconnect(request, drain)
    return None if disconnected else (["".join(t) for t in texts], scored)


class EchoOnly:
    """A completion of 0 tokens without logprobs (`echo` with `max_tokens` 0): each choice
    is the echoed prompt, ended by "length"; nothing for the engine to do. It stands in for
    a `RequestRun` where the routes read one (`n`: all the choices of all the prompts)."""

    def __init__(self, n: int, prompt_tokens: int) -> None:
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.total_completion_tokens = 0
        self.finish_reasons: list[str | None] = ["length"] * n

    async def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        for index in range(self.n):
            yield index, TokenDelta(None, "", "length")

    async def close(self) -> None:
        return None


def _sse(
    state: ServerState, body: AsyncIterator[bytes], run: RequestRun | BatchRun | EchoOnly
) -> Response:
    settings = state.settings
    return ClosingEventSourceResponse(
        body,
        on_close=run.close,
        ping_s=settings.sse_ping_s,
        send_timeout_s=settings.sse_send_timeout_s,
        shutdown_grace_s=settings.shutdown_grace_s,
    )


# ---- /v1/completions ----


@router.post("/completions", response_model=CompletionResponse, responses=_STREAM_DOC)
async def create_completion(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    """One prompt, or a batch of them (each its own run, choice `i * n + j` for prompt i's
    choice j); every prompt is checked before any engine work."""
    started = time.perf_counter()
    n = check_common(state, body)
    check_max_tokens_zero(body)
    prompts = await completion_prompts(state, body)
    logprobs = logprobs_of(state, body)
    prompt_logprobs = prompt_logprobs_of(state, body, logprobs)
    resolve_budgets(state, body, prompts)
    # max_tokens 0: the prompt alone, nothing generated (its parameters are still checked,
    # as a generation's); scored by the fill with logprobs, else nothing for the engine
    sampling = build_sampling(state, body, prompts[0].max_tokens or 1, logprobs=logprobs)
    if body.max_tokens == 0 and prompt_logprobs is None:
        run = EchoOnly(n * len(prompts), sum(len(p.ids) for p in prompts))
    else:
        plans = [
            (p.ids, None if not p.max_tokens else replace(sampling, max_tokens=p.max_tokens))
            for p in prompts
        ]
        run = await _admit(
            state, request, plans, n, "completions", started, bool(body.stream), prompt_logprobs
        )
    if run is None:
        return Response(status_code=499)  # the client left during the prefill
    meta = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.model_name,
    }
    # each choice's echo: its own prompt's text
    echoes = [p.text if body.echo else "" for p in prompts for _ in range(n)]
    token_texts = TokenTexts(state.engine) if logprobs is not None else None
    # echo with logprobs: the fill's entries of each choice's prompt, first on the choice
    scored_prompt = None if prompt_logprobs is None else run.choice_prompt
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = completion_events(run, meta, echoes, include_usage, token_texts, scored_prompt)
        return _sse(state, events, run)
    try:
        collected = await _collect(run, request)
    finally:
        await run.close()
    if collected is None:
        return Response(status_code=499)  # nobody is listening
    texts, scored = collected
    choices = [
        CompletionChoice(
            index=i,
            text=echoes[i] + t,
            logprobs=None
            if token_texts is None
            else CompletionOffsets(token_texts).take(
                s, None if scored_prompt is None else scored_prompt(i)
            ),
            finish_reason=run.finish_reasons[i],
        )
        for i, (t, s) in enumerate(zip(texts, scored, strict=True))
    ]
    return CompletionResponse(**meta, choices=choices, usage=usage_of(run))


# ---- /v1/chat/completions ----


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_STREAM_DOC)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    started = time.perf_counter()
    n = check_common(state, body)
    plan = await chat_prompt(state, body)
    logprobs = logprobs_of(state, body)
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(state, requested, len(plan.prompt_ids), param)
    sampling = build_sampling(state, body, max_tokens, plan.constraint, logprobs)
    run = await _admit(
        state, request, [(plan.prompt_ids, sampling)], n, "chat", started, bool(body.stream)
    )
    if run is None:
        return Response(status_code=499)
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.model_name,
    }
    token_texts = TokenTexts(state.engine) if logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = chat_events(run, meta, include_usage, plan.parse_tools, token_texts)
        return _sse(state, events, run)
    try:
        collected = await _collect(run, request)
    finally:
        await run.close()
    if collected is None:
        return Response(status_code=499)
    texts, scored = collected
    choices = []
    for i, text in enumerate(texts):
        message, finish = chat_message(text, run.finish_reasons[i], plan.parse_tools)
        lp = None if token_texts is None else chat_logprobs(token_texts, scored[i])
        choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=finish))
    return ChatCompletionResponse(**meta, choices=choices, usage=usage_of(run))
