"""ChatParrot: a LangChain chat model over parrot-backend's `/v1/chat/completions`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, Field

from ._base import ParrotParams, usage_dict
from ._wire import ChatCompletion, ChatCompletionChunk, Usage, parse

CHAT_PATH = "/v1/chat/completions"
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
_SERVER_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# the model's own notes are not resent; tool-use blocks travel as `tool_calls` instead
_SKIPPED_BLOCKS = frozenset({"reasoning", "thinking", "tool_use", "tool_call"})
_TOOL_CHOICES = {"auto": "auto", "none": "none", "required": "required", "any": "required"}
StructuredMethod = Literal["json_schema", "function_calling", "json_mode"]


class ChatParrot(ParrotParams, BaseChatModel):
    """Chat model served by parrot-backend (its OpenAI-compatible chat route).

    The server applies the model's chat template; this class sends messages, sampling
    settings and `stop`, and reads back text, `finish_reason`, the model name and token
    usage (on the message, and on the last chunk of a stream).

    ```python
    from langchain_parrot import ChatParrot

    chat = ChatParrot(temperature=0, max_tokens=64)   # $PARROT_BASE_URL or 127.0.0.1:8000
    print(chat.invoke("Name three birds.").text)
    for chunk in chat.stream("Write a haiku about parrots."):
        print(chunk.text, end="", flush=True)
    ```

    Tools (`bind_tools`, with `tool_choice`) and structured output
    (`with_structured_output`: `json_schema`, `function_calling` or `json_mode`) use the
    server's OpenAI tool calling and response formats; a forced call or a JSON schema is
    enforced while decoding, so it always parses. Text content only: an image or other
    non-text block raises ValueError.
    """

    logprobs: bool | None = None
    """Return each generated token's log probability (in `response_metadata["logprobs"]`,
    OpenAI's `{"content": [{token, logprob, bytes, top_logprobs}]}`, streamed chunks'
    entries merged as they arrive)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """With `logprobs`: how many most likely alternatives to return per token (0-20)."""

    @property
    def _llm_type(self) -> str:
        return "parrot-chat"

    @property
    def _logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._parrot_identifying_params, **self._logprob_fields}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        return self._fill_ls_params(params, stop, kwargs)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer `tools` to the model (anything `convert_to_openai_tool` takes).

        `tool_choice`: "auto" (the model decides), "none", "required" or "any" (some
        call), a tool's name or `{"type": "function", "function": {"name": ...}}` (that
        tool), True (the only tool). A forced call is decoded under the tools' schemas, so
        its arguments always parse. `strict` is accepted for compatibility (the server
        enforces the schema of every forced call either way)."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """A runnable whose output is `schema` (a pydantic class, a TypedDict or a JSON
        schema dict): parsed into the class, else a dict.

        `method`: `json_schema` (the server's `response_format`, enforced while decoding),
        `function_calling` (a forced call of one tool named after the schema) or
        `json_mode` (any JSON object; say in the prompt what it should hold).
        `include_raw`: return `{"raw", "parsed", "parsing_error"}` instead of raising on a
        reply that does not parse."""
        if kwargs:
            raise ValueError(f"unexpected arguments: {sorted(kwargs)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method {method!r} needs a schema")
        is_model = isinstance(schema, type) and issubclass(schema, BaseModel)
        traced = {
            "kwargs": {"method": method, "strict": strict},
            "schema": convert_to_json_schema(schema) if schema is not None else None,
        }
        if method == "function_calling":
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                strict=strict,
                parallel_tool_calls=False,
                ls_structured_output_format=traced,
            )
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)
                if is_model
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method == "json_schema":
            json_schema = convert_to_json_schema(schema)
            fmt = {"name": json_schema.get("title") or "output", "schema": json_schema}
            if strict is not None:
                fmt["strict"] = strict
            llm = self.bind(
                response_format={"type": "json_schema", "json_schema": fmt},
                ls_structured_output_format=traced,
            )
            parser = (
                PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
            )
        elif method == "json_mode":
            llm = self.bind(
                response_format={"type": "json_object"}, ls_structured_output_format=traced
            )
            parser = (
                PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
            )
        else:
            raise ValueError(
                f"method must be json_schema, function_calling or json_mode, got {method!r}"
            )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        stream: bool,
    ) -> dict[str, Any]:
        payload = self._payload(stop, {**self._set(self._logprob_fields), **kwargs})
        payload["messages"] = [message_to_dict(m) for m in messages]
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return payload

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        payload = self._request(messages, stop, kwargs, stream=False)
        return chat_result(self._transport().post(CHAT_PATH, payload))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        payload = self._request(messages, stop, kwargs, stream=False)
        async with self._atransport() as transport:
            body = await transport.post(CHAT_PATH, payload)
        return chat_result(body)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        payload = self._request(messages, stop, kwargs, stream=True)
        state = _StreamState()
        for item in self._transport().stream(CHAT_PATH, payload):
            chunk = state.feed(item)
            if chunk is not None:
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        last = state.last()
        if run_manager:
            run_manager.on_llm_new_token(last.text, chunk=last)
        yield last

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        payload = self._request(messages, stop, kwargs, stream=True)
        state = _StreamState()
        async with self._atransport() as transport:
            async for item in transport.stream(CHAT_PATH, payload):
                chunk = state.feed(item)
                if chunk is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        last = state.last()
        if run_manager:
            await run_manager.on_llm_new_token(last.text, chunk=last)
        yield last


def message_to_dict(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as an OpenAI chat message (text content only)."""
    if isinstance(message, ChatMessage):
        role = message.role
    else:
        role = _ROLES.get(message.type, "")
    if role not in _SERVER_ROLES:
        raise ValueError(
            f"ChatParrot cannot send a {message.type!r} message "
            f"(role {role or message.type!r}); use system, human, ai or tool"
        )
    out: dict[str, Any] = {"role": role, "content": _content(message)}
    if message.name:
        out["name"] = message.name
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call["id"] or f"call_{i}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call["args"], ensure_ascii=False),
                },
            }
            for i, call in enumerate(message.tool_calls)
        ]
    return out


def _tool_choice(choice: dict | str | bool, tools: list[dict[str, Any]]) -> dict | str:
    """LangChain's tool_choice spellings as the server's."""
    if choice is True:
        if len(tools) != 1:
            raise ValueError("tool_choice=True needs exactly one tool")
        choice = tools[0]["function"]["name"]
    if isinstance(choice, str):
        if choice in _TOOL_CHOICES:
            return _TOOL_CHOICES[choice]
        return {"type": "function", "function": {"name": choice}}
    if isinstance(choice, dict):
        return choice
    raise ValueError(f"unsupported tool_choice {choice!r}")


def _content(message: BaseMessage) -> str | list[dict[str, str]]:
    if isinstance(message.content, str):
        return message.content
    parts: list[dict[str, str]] = []
    for block in message.content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind not in _SKIPPED_BLOCKS:
            raise ValueError(
                f"ChatParrot sends text only; this {message.type} message has "
                f"a {kind!r} content block"
            )
    return parts if parts else ""


def usage_metadata(usage: Usage | None) -> UsageMetadata | None:
    """The server's token counts as LangChain's UsageMetadata."""
    if usage is None:
        return None
    return UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def chat_result(body: Any) -> ChatResult:
    """A ChatResult from a `/v1/chat/completions` body (validated first)."""
    completion = parse(ChatCompletion, body, "chat completion")
    generations = []
    for choice in sorted(completion.choices, key=lambda c: c.index):
        calls, invalid = _tool_calls(choice.message.tool_calls or [])
        message = AIMessage(
            content=choice.message.content or "",
            tool_calls=calls,
            invalid_tool_calls=invalid,
            id=completion.id,
            usage_metadata=usage_metadata(completion.usage),
            response_metadata={
                "model_name": completion.model,
                "model_provider": "parrot",
                "finish_reason": choice.finish_reason,
            },
        )
        info: dict[str, Any] = {"finish_reason": choice.finish_reason}
        if choice.logprobs is not None:
            info["logprobs"] = choice.logprobs
        generations.append(ChatGeneration(message=message, generation_info=info))
    llm_output: dict[str, Any] = {"model_name": completion.model}
    if completion.usage is not None:
        llm_output["token_usage"] = usage_dict(completion.usage)
    return ChatResult(generations=generations, llm_output=llm_output)


def _tool_calls(wire: list) -> tuple[list, list]:
    """The server's tool calls as LangChain tool calls; arguments that do not parse (a
    call cut by max_tokens) become invalid tool calls."""
    calls, invalid = [], []
    for call in wire:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError as exc:
            invalid.append(
                invalid_tool_call(
                    name=call.function.name,
                    id=call.id,
                    args=call.function.arguments,
                    error=str(exc),
                )
            )
            continue
        if not isinstance(args, dict):
            invalid.append(
                invalid_tool_call(
                    name=call.function.name,
                    id=call.id,
                    args=call.function.arguments,
                    error="arguments are not a JSON object",
                )
            )
            continue
        calls.append(tool_call(name=call.function.name, args=args, id=call.id))
    return calls, invalid


class _StreamState:
    """Turns chat stream chunks into ChatGenerationChunks; what ends the stream (model,
    finish reason, usage) goes on one last chunk, so merging chunks counts usage once."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def feed(self, item: dict) -> ChatGenerationChunk | None:
        chunk = parse(ChatCompletionChunk, item, "chat stream chunk")
        self.model = chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        text = ""
        calls = []
        logprobs: list[Any] = []
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # one choice per request: the others are never asked for
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            logprobs.extend((choice.logprobs or {}).get("content") or ())
            text += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                # merged by index: the first piece has id and name, later ones arguments
                calls.append(
                    tool_call_chunk(
                        name=part.function.name,
                        id=part.id,
                        args=part.function.arguments,
                        index=part.index,
                    )
                )
        if not text and not calls and not logprobs:
            return None
        message = AIMessageChunk(content=text, tool_call_chunks=calls)
        # entries of the chunks' tokens; merging the chunks concatenates the lists
        info = {"logprobs": {"content": logprobs}} if logprobs else None
        return ChatGenerationChunk(message=message, generation_info=info)

    def last(self) -> ChatGenerationChunk:
        metadata: dict[str, Any] = {"finish_reason": self.finish_reason, "model_provider": "parrot"}
        if self.model is not None:
            metadata["model_name"] = self.model
        message = AIMessageChunk(
            content="",
            usage_metadata=usage_metadata(self.usage),
            response_metadata=metadata,
            chunk_position="last",
        )
        return ChatGenerationChunk(
            message=message, generation_info={"finish_reason": self.finish_reason}
        )
