"""The server's response bodies and stream chunks, validated before anything reads them.

Only the fields this package uses are declared; others are ignored. A body that lacks one
becomes a `ParrotResponseError` naming the field, never a `KeyError` deep in a callback.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ParrotResponseError

W = TypeVar("W", bound="Wire")


class Wire(BaseModel):
    """Base of the wire models: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


class Usage(Wire):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(Wire):
    """The function a tool call names, and its arguments as JSON text."""

    name: str
    arguments: str = ""


class ToolCall(Wire):
    """One tool call of a (non-streamed) assistant message."""

    id: str
    function: FunctionCall


class ChatMessage(Wire):
    """The assistant message of a chat choice."""

    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Wire):
    """One choice of a chat completion."""

    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(Wire):
    """A whole (non-streamed) chat completion."""

    id: str | None = None
    model: str
    choices: list[ChatChoice] = Field(min_length=1)
    usage: Usage | None = None


class FunctionDelta(Wire):
    """A streamed call's name (first delta) or the next piece of its arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Wire):
    """A piece of a streamed tool call; `index` tells the calls apart."""

    index: int
    id: str | None = None
    function: FunctionDelta = Field(default_factory=FunctionDelta)


class ChatDelta(Wire):
    """The new part of a streamed chat message."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Wire):
    """One choice's delta in a chat stream chunk."""

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(Wire):
    """One chat stream chunk; the usage chunk has no choices."""

    id: str | None = None
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(Wire):
    """One choice of a text completion (whole or streamed)."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(Wire):
    """A whole text completion, or one stream chunk of one (then `choices` may be empty)."""

    id: str | None = None
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def parse(cls: type[W], data: object, what: str) -> W:
    """Validate `data` as `cls`; a `ParrotResponseError` naming the first bad field if not."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ParrotResponseError(
            f"malformed {what} from the server: {where}: {first['msg']}"
        ) from None
