"""SSE bodies for the OpenAI routes: chunk sequences exactly as OpenAI streams them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

from ..contract.engine import PromptEntry
from ..contract.errors import EngineError
from ..engine.grammar_tools import Event, ToolCallParser, parse_tool_calls
from .errors import APIError, from_engine_error
from .generation import BatchRun, RequestRun
from .openai_logprobs import CompletionOffsets, TokenTexts, chat_entries, has_logprob
from .openai_schemas import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from .sse import DONE_FRAME, data_frame

log = logging.getLogger(__name__)


def usage_of(run: RequestRun | BatchRun) -> Usage:
    """The request's usage (a batch's: summed over its prompts and all their choices), for
    the response and the streamed usage chunk alike: completion tokens are every delta that
    carried a token id, the EOS that ended a choice included (what native calls count too,
    `CallRunner.tokens`)."""
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
    run: RequestRun | BatchRun,
    meta: dict,
    echoes: Sequence[str],
    include_usage: bool,
    token_texts: TokenTexts | None = None,
    scored_prompt: Callable[[int], tuple[list[int], list[PromptEntry | None] | None]] | None = None,
) -> AsyncIterator[bytes]:
    """`echoes[i]`: the text choice i's first chunk starts with (its prompt's, with echo).
    With `token_texts` (logprobs asked), each chunk carries the logprobs of its
    choice's tokens since that choice's previous chunk (`openai_logprobs`); with
    `scored_prompt` (echo with logprobs: choice i's prompt ids and the fill's entries,
    `RequestRun.choice_prompt`, known once a delta of it came), a choice's first chunk,
    which carries the echoed prompt, has its prompt's entries first."""
    echoed: set[int] = set()
    offsets = [CompletionOffsets(token_texts) for _ in range(run.n)] if token_texts else None
    pending: list[list] = [[] for _ in range(run.n)]
    scored: set[int] = set()  # the choices whose chunks carried the prompt's entries

    def take(index: int) -> CompletionLogprobs | None:
        if offsets is None:
            return None
        prompt = None
        if scored_prompt is not None and index not in scored:
            scored.add(index)
            prompt = scored_prompt(index)
        out = offsets[index].take(pending[index], prompt)
        pending[index] = []
        return out

    try:
        async for index, delta in run:
            text = delta.text
            if echoes[index] and index not in echoed:
                echoed.add(index)
                text = echoes[index] + text
            if offsets is not None and has_logprob(delta):
                pending[index].append(delta)
            if text:
                yield _completion_chunk(meta, index, text, None, take(index))
            if delta.finish_reason is not None:
                yield _completion_chunk(meta, index, "", delta.finish_reason, take(index))
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


def _completion_chunk(
    meta: dict, index: int, text: str, finish: str | None, logprobs: CompletionLogprobs | None
) -> bytes:
    choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
    chunk = CompletionChunk(**meta, choices=[choice])
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


def _tool_deltas(
    meta: dict,
    index: int,
    events: list[Event],
    ids: dict[int, str],
    logprobs: Callable[[], ChoiceLogprobs | None] = lambda: None,
) -> list[bytes]:
    """Chunks for what a parser found: content as content, each call's first delta with
    its id and name, then its arguments as they grow; `logprobs()`: the entries the next
    chunk carries."""
    out = []
    for kind, call, text in events:
        if kind == "content":
            out.append(_chat_chunk(meta, index, ChatDelta(content=text), None, logprobs()))
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
        out.append(_chat_chunk(meta, index, ChatDelta(tool_calls=[part]), None, logprobs()))
    return out


async def chat_events(
    run: RequestRun,
    meta: dict,
    include_usage: bool,
    parse_tools: bool = False,
    token_texts: TokenTexts | None = None,
) -> AsyncIterator[bytes]:
    """With `token_texts` (logprobs asked), a chunk carries the logprobs of its choice's
    tokens since that choice's previous chunk that carried any (`openai_logprobs`): the
    tokens of a tool call's text go with the chunks the parser makes of it."""
    parsers = [ToolCallParser() for _ in range(run.n)] if parse_tools else None
    ids: list[dict[int, str]] = [{} for _ in range(run.n)]
    pending: list[list] = [[] for _ in range(run.n)]

    def take(index: int) -> ChoiceLogprobs | None:
        if not pending[index]:
            return None
        entries = chat_entries(token_texts, pending[index])
        pending[index] = []
        return ChoiceLogprobs(content=entries)

    try:
        # The first delta of each choice carries the role, as OpenAI's does.
        for index in range(run.n):
            yield _chat_chunk(meta, index, ChatDelta(role="assistant", content=""), None)
        async for index, delta in run:
            if token_texts is not None and has_logprob(delta):
                pending[index].append(delta)
            if parsers is None:
                if delta.text:
                    yield _chat_chunk(meta, index, ChatDelta(content=delta.text), None, take(index))
                if delta.finish_reason is not None:
                    yield _chat_chunk(meta, index, ChatDelta(), delta.finish_reason, take(index))
                continue
            parser = parsers[index]
            lp = partial(take, index)
            if delta.text:
                for chunk in _tool_deltas(meta, index, parser.feed(delta.text), ids[index], lp):
                    yield chunk
            if delta.finish_reason is not None:
                for chunk in _tool_deltas(meta, index, parser.finish(), ids[index], lp):
                    yield chunk
                finish = tool_finish(delta.finish_reason, bool(parser.calls))
                yield _chat_chunk(meta, index, ChatDelta(), finish, take(index))
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


def _chat_chunk(
    meta: dict,
    index: int,
    delta: ChatDelta,
    finish: str | None,
    logprobs: ChoiceLogprobs | None = None,
) -> bytes:
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
    chunk = ChatCompletionChunk(**meta, choices=[choice])
    return data_frame(chunk.model_dump(mode="json"))
