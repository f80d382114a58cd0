"""ParrotLLM: a LangChain text-completion model over parrot-backend's `/v1/completions`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field

from ._base import ParrotParams, usage_dict
from ._wire import Completion, CompletionChoice, Usage, parse
from .errors import ParrotResponseError

COMPLETIONS_PATH = "/v1/completions"


class ParrotLLM(ParrotParams, BaseLLM):
    """Text-completion model served by parrot-backend (its OpenAI-compatible completions
    route): the prompt is sent as it is, with no chat template.

    ```python
    from langchain_parrot import ParrotLLM

    llm = ParrotLLM(temperature=0, max_tokens=32)
    print(llm.invoke("The capital of France is"))
    print(llm.batch(["1, 2, 3,", "a, b, c,"]))
    ```

    `batch` sends its prompts as concurrent requests (at most `parallel_requests` at a
    time), which the engine batches continuously. Usage of a `generate` call is in
    `llm_output["token_usage"]`; each stream ends with an empty chunk whose
    `generation_info` holds `finish_reason`, `model_name` and `token_usage`.
    """

    max_tokens: int | None = 256
    """Most tokens to generate (the server's own default for completions is 16)."""
    parallel_requests: int = Field(default=8, ge=1)
    """How many prompts of one batch are in flight at once."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Return each generated token's log probability and this many most likely
    alternatives (0-20), in `generation_info["logprobs"]` (OpenAI's `{tokens,
    token_logprobs, top_logprobs, text_offset}`; a stream's chunks carry their tokens'
    entries, concatenated when the chunks are added)."""

    @property
    def _llm_type(self) -> str:
        return "parrot"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._parrot_identifying_params, "logprobs": self.logprobs}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        return self._fill_ls_params(params, stop, kwargs)

    def _request(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any], stream: bool
    ) -> dict[str, Any]:
        payload = self._payload(stop, {**self._set({"logprobs": self.logprobs}), **kwargs})
        payload["prompt"] = prompt
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return payload

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:
            chunks = [_join(self._stream(p, stop, run_manager, **kwargs)) for p in prompts]
            return _streamed_result(chunks)
        transport = self._transport()
        payloads = [self._request(p, stop, kwargs, stream=False) for p in prompts]
        if len(payloads) == 1:
            bodies = [transport.post(COMPLETIONS_PATH, payloads[0])]
        else:
            workers = min(len(payloads), self.parallel_requests)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                bodies = list(pool.map(lambda p: transport.post(COMPLETIONS_PATH, p), payloads))
        return llm_result(bodies)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:
            chunks = [await _ajoin(self._astream(p, stop, run_manager, **kwargs)) for p in prompts]
            return _streamed_result(chunks)
        payloads = [self._request(p, stop, kwargs, stream=False) for p in prompts]
        bound = asyncio.Semaphore(self.parallel_requests)
        async with self._atransport() as transport:

            async def one(payload: dict[str, Any]) -> Any:
                async with bound:
                    return await transport.post(COMPLETIONS_PATH, payload)

            bodies = await asyncio.gather(*(one(p) for p in payloads))
        return llm_result(list(bodies))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        payload = self._request(prompt, stop, kwargs, stream=True)
        state = _StreamState()
        for item in self._transport().stream(COMPLETIONS_PATH, payload):
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
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        payload = self._request(prompt, stop, kwargs, stream=True)
        state = _StreamState()
        async with self._atransport() as transport:
            async for item in transport.stream(COMPLETIONS_PATH, payload):
                chunk = state.feed(item)
                if chunk is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        last = state.last()
        if run_manager:
            await run_manager.on_llm_new_token(last.text, chunk=last)
        yield last


def llm_result(bodies: list[Any]) -> LLMResult:
    """An LLMResult from one `/v1/completions` body per prompt (validated first)."""
    generations: list[list[Generation]] = []
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    model = None
    for body in bodies:
        completion = parse(Completion, body, "completion")
        if not completion.choices:
            raise ParrotResponseError("malformed completion from the server: no choices")
        model = completion.model
        generations.append(
            [
                Generation(text=c.text, generation_info=_info(c))
                for c in sorted(completion.choices, key=lambda c: c.index)
            ]
        )
        if completion.usage is not None:
            for key, value in usage_dict(completion.usage).items():
                total[key] += value
    return LLMResult(
        generations=generations, llm_output={"token_usage": total, "model_name": model}
    )


def _info(choice: CompletionChoice) -> dict[str, Any]:
    info: dict[str, Any] = {"finish_reason": choice.finish_reason}
    if choice.logprobs is not None:
        info["logprobs"] = choice.logprobs
    return info


def _join(chunks: Iterator[GenerationChunk]) -> GenerationChunk:
    joined: GenerationChunk | None = None
    for chunk in chunks:
        joined = chunk if joined is None else joined + chunk
    assert joined is not None  # _stream always yields its last chunk
    return joined


async def _ajoin(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    joined: GenerationChunk | None = None
    async for chunk in chunks:
        joined = chunk if joined is None else joined + chunk
    assert joined is not None
    return joined


def _streamed_result(chunks: list[GenerationChunk]) -> LLMResult:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    model = None
    generations = []
    for chunk in chunks:
        info = dict(chunk.generation_info or {})
        model = info.pop("model_name", model)
        for key, value in (info.pop("token_usage", None) or {}).items():
            total[key] += value
        generations.append([Generation(text=chunk.text, generation_info=info)])
    return LLMResult(
        generations=generations, llm_output={"token_usage": total, "model_name": model}
    )


class _StreamState:
    """Turns completion stream chunks into GenerationChunks; the finish reason, model and
    usage go on one last, empty chunk."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def feed(self, item: dict) -> GenerationChunk | None:
        chunk = parse(Completion, item, "completion stream chunk")
        self.model = chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        text = ""
        logprobs: dict[str, list] = {}
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # one choice per request
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            text += choice.text
            for key, entries in (choice.logprobs or {}).items():
                logprobs.setdefault(key, []).extend(entries or ())
        if not text and not any(logprobs.values()):
            return None
        return GenerationChunk(
            text=text, generation_info={"logprobs": logprobs} if logprobs else None
        )

    def last(self) -> GenerationChunk:
        info: dict[str, Any] = {"finish_reason": self.finish_reason, "model_name": self.model}
        if self.usage is not None:
            info["token_usage"] = usage_dict(self.usage)
        return GenerationChunk(text="", generation_info=info)
