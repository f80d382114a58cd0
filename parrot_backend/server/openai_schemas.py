"""Pydantic models of the OpenAI-compatible requests and responses.

Requests validate in strict mode (no "1" -> 1 coercion, no NaN/inf): a wrong type is a 400
that names the field, not a surprise later. Unknown fields are ignored, as OpenAI's own
SDKs and LangChain send parameters we do not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_serializer
from pydantic_core import PydanticCustomError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Request):
    type: Literal["text"]
    text: str


def _one_of(description: str) -> WrapValidator:
    """Replace a union's per-member error list with one sentence naming the accepted forms."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"must be {description}") from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[str] | list[int] | list[list[int]],
    _one_of("a string, a list of strings, a list of token ids or a list of token id lists"),
]
Stop = Annotated[str | list[str] | None, _one_of("a string, a list of strings or null")]
Content = Annotated[
    str | list[TextPart] | None,
    _one_of("a string, null or a list of {'type': 'text', 'text': ...} parts"),
]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(min_length=1, max_length=512)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, description="Extension: 0 disables it.")
    n: int | None = Field(default=1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=512)
    ignore_eos: bool | None = Field(default=False, description="Extension: generate past EOS.")


class CompletionRequest(_SamplingFields):
    prompt: Prompt = Field(
        description="A string, token ids, or a batch: a list of strings or of token id lists "
        "(`max_prompts` at most; prompt i's choice j has index i * n + j)."
    )
    max_tokens: int | None = Field(
        default=16, ge=0, description="0 only with echo: the prompt alone (scored with logprobs)."
    )
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(_Request):
    name: str = Field(max_length=64)
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class ToolCall(_Request):
    """A tool call of an earlier assistant message, sent back with the conversation."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON schema of the arguments; omitted: any object"
    )
    strict: bool | None = Field(
        default=None,
        description="Arguments always match "
        "`parameters` when the call is forced; accepted either way.",
    )


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _one_of("'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"),
]


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated alias.")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        default=None, description="Default: 'auto' with tools, 'none' without."
    )
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = True
    chat_template: str | None = Field(
        default=None, description="Extension, off unless the operator allows it."
    )


# ---- responses ----


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parrot"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: per generated token, its text, logprob, the
    top alternatives by text (the token itself included) and its offset in the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class _DropNone(_Response):
    """Leaves out the None fields named in `_optional`, as OpenAI's stream chunks do."""

    _optional: frozenset[str] = frozenset()

    @model_serializer(mode="wrap")
    def _drop(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in self._optional and v is None)}


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_DropNone):
    _optional = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(_DropNone):
    _optional = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_DropNone):
    """A streamed tool call: its first delta carries id, type and name; later ones append
    to the arguments."""

    _optional = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_DropNone):
    _optional = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_DropNone):
    _optional = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_DropNone):
    _optional = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Health(_Response):
    status: Literal["ok"]
