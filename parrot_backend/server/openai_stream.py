"""SSE bodies for the OpenAI routes: chunk sequences exactly as OpenAI streams them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from ..contract.errors import EngineError
from ..engine.grammar_tools import Event, ToolCallParser, parse_tool_calls
from .errors import APIError, from_engine_error
from .generation import RequestRun
from .openai_schemas import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from .sse import DONE_FRAME, data_frame

log = logging.getLogger(__name__)


def usage_of(run: RequestRun) -> Usage:
    """The request's usage, for the response and the streamed usage chunk alike: completion
    tokens are every delta that carried a token id, the EOS that ended a choice included
    (what native calls count too, `CallRunner.tokens`)."""
    return Usage(
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.total_completion_tokens,
        total_tokens=run.prompt_tokens + run.total_completion_tokens,
    )


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


async def completion_events(
    run: RequestRun, meta: dict, echo: str, include_usage: bool
) -> AsyncIterator[bytes]:
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
            yield data_frame(
                CompletionChunk(**meta, choices=[], usage=usage_of(run)).model_dump(mode="json")
            )
        yield DONE_FRAME
    except Exception as exc:
        yield error_frame(exc)
        yield DONE_FRAME
    finally:
        await run.close()


def _completion_chunk(meta: dict, index: int, text: str, finish: str | None) -> bytes:
    chunk = CompletionChunk(
        **meta, choices=[CompletionChoice(index=index, text=text, finish_reason=finish)]
    )
    return data_frame(chunk.model_dump(mode="json"))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason: a generation that ended by itself after calling tools ended
    with `tool_calls`; one cut by max_tokens stays `length`."""
    return "tool_calls" if has_calls and finish == "stop" else finish


def chat_message(
    text: str, finish: str | None, parse_tools: bool
) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a whole generation, its tool calls parsed out if asked."""
    if not parse_tools:
        return AssistantMessage(content=text), finish
    content, calls = parse_tool_calls(text)
    if not calls:
        return AssistantMessage(content=text), finish
    tool_calls = [
        ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return (
        AssistantMessage(content=content or None, tool_calls=tool_calls),
        tool_finish(finish, True),
    )


def _tool_deltas(meta: dict, index: int, events: list[Event], ids: dict[int, str]) -> list[bytes]:
    """Chunks for what a parser found: content as content, each call's first delta with
    its id and name, then its arguments as they grow."""
    out = []
    for kind, call, text in events:
        if kind == "content":
            out.append(_chat_chunk(meta, index, ChatDelta(content=text), None))
            continue
        if kind == "call":
            ids[call] = new_call_id()
            part = ToolCallDelta(
                index=call,
                id=ids[call],
                type="function",
                function=FunctionDelta(name=text, arguments=""),
            )
        else:
            part = ToolCallDelta(index=call, function=FunctionDelta(arguments=text))
        out.append(_chat_chunk(meta, index, ChatDelta(tool_calls=[part]), None))
    return out


async def chat_events(
    run: RequestRun, meta: dict, include_usage: bool, parse_tools: bool = False
) -> AsyncIterator[bytes]:
    parsers = [ToolCallParser() for _ in range(run.n)] if parse_tools else None
    ids: list[dict[int, str]] = [{} for _ in range(run.n)]
    try:
        # The first delta of each choice carries the role, as OpenAI's does.
        for index in range(run.n):
            yield _chat_chunk(meta, index, ChatDelta(role="assistant", content=""), None)
        async for index, delta in run:
            if parsers is None:
                if delta.text:
                    yield _chat_chunk(meta, index, ChatDelta(content=delta.text), None)
                if delta.finish_reason is not None:
                    yield _chat_chunk(meta, index, ChatDelta(), delta.finish_reason)
                continue
            parser = parsers[index]
            if delta.text:
                for chunk in _tool_deltas(meta, index, parser.feed(delta.text), ids[index]):
                    yield chunk
            if delta.finish_reason is not None:
                for chunk in _tool_deltas(meta, index, parser.finish(), ids[index]):
                    yield chunk
                finish = tool_finish(delta.finish_reason, bool(parser.calls))
                yield _chat_chunk(meta, index, ChatDelta(), finish)
        if include_usage:
            yield data_frame(
                ChatCompletionChunk(**meta, choices=[], usage=usage_of(run)).model_dump(mode="json")
            )
        yield DONE_FRAME
    except Exception as exc:
        yield error_frame(exc)
        yield DONE_FRAME
    finally:
        await run.close()


def _chat_chunk(meta: dict, index: int, delta: ChatDelta, finish: str | None) -> bytes:
    chunk = ChatCompletionChunk(
        **meta, choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish)]
    )
    return data_frame(chunk.model_dump(mode="json"))
