"""ChatParrot: a LangChain chat model over parrot-backend's `/v1/chat/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from ._base import ParrotParams, usage_dict
from ._wire import ChatCompletion, ChatCompletionChunk, Usage, parse

CHAT_PATH = "/v1/chat/completions"
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
_SERVER_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SKIPPED_BLOCKS = frozenset({"reasoning", "thinking"})  # the model's own notes: not resent


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

    Text content only: an image or other non-text block raises ValueError. Tool calling
    and structured output are not offered yet.
    """

    @property
    def _llm_type(self) -> str:
        return "parrot-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._parrot_identifying_params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        return self._fill_ls_params(params, stop, kwargs)

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any], stream: bool) -> dict[str, Any]:
        payload = self._payload(stop, kwargs)
        payload["messages"] = [message_to_dict(m) for m in messages]
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return payload

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        payload = self._request(messages, stop, kwargs, stream=False)
        return chat_result(self._transport().post(CHAT_PATH, payload))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        payload = self._request(messages, stop, kwargs, stream=False)
        async with self._atransport() as transport:
            body = await transport.post(CHAT_PATH, payload)
        return chat_result(body)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
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

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
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
        raise ValueError(f"ChatParrot cannot send a {message.type!r} message "
                         f"(role {role or message.type!r}); use system, human, ai or tool")
    out: dict[str, Any] = {"role": role, "content": _content(message)}
    if message.name:
        out["name"] = message.name
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


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
            raise ValueError(f"ChatParrot sends text only; this {message.type} message has "
                             f"a {kind!r} content block")
    return parts if parts else ""


def usage_metadata(usage: Usage | None) -> UsageMetadata | None:
    """The server's token counts as LangChain's UsageMetadata."""
    if usage is None:
        return None
    return UsageMetadata(input_tokens=usage.prompt_tokens,
                         output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens)


def chat_result(body: Any) -> ChatResult:
    """A ChatResult from a `/v1/chat/completions` body (validated first)."""
    completion = parse(ChatCompletion, body, "chat completion")
    generations = []
    for choice in sorted(completion.choices, key=lambda c: c.index):
        message = AIMessage(
            content=choice.message.content or "",
            id=completion.id,
            usage_metadata=usage_metadata(completion.usage),
            response_metadata={"model_name": completion.model, "model_provider": "parrot",
                               "finish_reason": choice.finish_reason},
        )
        generations.append(ChatGeneration(
            message=message, generation_info={"finish_reason": choice.finish_reason}))
    llm_output: dict[str, Any] = {"model_name": completion.model}
    if completion.usage is not None:
        llm_output["token_usage"] = usage_dict(completion.usage)
    return ChatResult(generations=generations, llm_output=llm_output)


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
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # one choice per request: the others are never asked for
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            text += choice.delta.content or ""
        if not text:
            return None
        return ChatGenerationChunk(message=AIMessageChunk(content=text))

    def last(self) -> ChatGenerationChunk:
        metadata: dict[str, Any] = {"finish_reason": self.finish_reason,
                                    "model_provider": "parrot"}
        if self.model is not None:
            metadata["model_name"] = self.model
        message = AIMessageChunk(content="", usage_metadata=usage_metadata(self.usage),
                                 response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message,
                                   generation_info={"finish_reason": self.finish_reason})
