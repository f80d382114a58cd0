"""SSE bodies for the OpenAI routes: chunk sequences exactly as OpenAI streams them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ..engine.errors import EngineError
from .errors import APIError, from_engine_error
from .generation import RequestRun
from .openai_schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    Usage,
)
from .sse import DONE_FRAME, data_frame

log = logging.getLogger(__name__)


def usage_of(run: RequestRun) -> Usage:
    return Usage(prompt_tokens=run.prompt_tokens, completion_tokens=run.total_completion_tokens,
                 total_tokens=run.prompt_tokens + run.total_completion_tokens)


def error_frame(exc: Exception) -> bytes:
    """Headers are already sent, so a failure becomes an `error` payload; the openai SDK
    raises on it, so clients see the failure instead of a silently short answer."""
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, EngineError):
        err = from_engine_error(exc)
    else:
        log.error("generation failed mid-stream: %r", exc)
        err = APIError(500, "internal error during generation", type="server_error")
    return data_frame(err.body())


async def completion_events(run: RequestRun, meta: dict, echo: str,
                             include_usage: bool) -> AsyncIterator[bytes]:
    echoed: set[int] = set()
    try:
        async for index, delta in run:
            text = delta.text
            if echo and index not in echoed:
                echoed.add(index)
                text = echo + text
            if text:
                yield _completion_chunk(meta, index, text, None)
            if delta.finish_reason is not None:
                yield _completion_chunk(meta, index, "", delta.finish_reason)
        if include_usage:
            yield data_frame(CompletionChunk(**meta, choices=[], usage=usage_of(run))
                             .model_dump(mode="json"))
        yield DONE_FRAME
    except Exception as exc:
        yield error_frame(exc)
        yield DONE_FRAME
    finally:
        await run.close()


def _completion_chunk(meta: dict, index: int, text: str, finish: str | None) -> bytes:
    chunk = CompletionChunk(**meta, choices=[CompletionChoice(index=index, text=text,
                                                              finish_reason=finish)])
    return data_frame(chunk.model_dump(mode="json"))


async def chat_events(run: RequestRun, meta: dict, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        # The first delta of each choice carries the role, as OpenAI's does.
        for index in range(run.n):
            yield _chat_chunk(meta, index, ChatDelta(role="assistant", content=""), None)
        async for index, delta in run:
            if delta.text:
                yield _chat_chunk(meta, index, ChatDelta(content=delta.text), None)
            if delta.finish_reason is not None:
                yield _chat_chunk(meta, index, ChatDelta(), delta.finish_reason)
        if include_usage:
            yield data_frame(ChatCompletionChunk(**meta, choices=[], usage=usage_of(run))
                             .model_dump(mode="json"))
        yield DONE_FRAME
    except Exception as exc:
        yield error_frame(exc)
        yield DONE_FRAME
    finally:
        await run.close()


def _chat_chunk(meta: dict, index: int, delta: ChatDelta, finish: str | None) -> bytes:
    chunk = ChatCompletionChunk(**meta, choices=[ChatChunkChoice(index=index, delta=delta,
                                                                 finish_reason=finish)])
    return data_frame(chunk.model_dump(mode="json"))
