"""ParrotLLM against the session's real server (langchain-tests has no LLM suite).

Greedy decoding makes outputs reproducible, so the paths are checked against each other:
a batch equals one invoke per prompt, a stream joins to the invoke's text.
"""

from __future__ import annotations

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler

from langchain_parrot import (
    ChatParrot,
    ParrotAuthenticationError,
    ParrotBadRequestError,
    ParrotConnectionError,
    ParrotLLM,
)

from .conftest import ParrotServer

PROMPTS = ["1, 2, 3, 4,", "Monday, Tuesday,", "The capital of France is"]


def _llm(server: ParrotServer) -> ParrotLLM:
    return ParrotLLM(
        base_url=server.url, api_key=server.api_key, temperature=0, max_tokens=12, timeout=120
    )


@pytest.fixture
def llm(parrot_server: ParrotServer) -> ParrotLLM:
    return _llm(parrot_server)


@pytest.fixture(scope="module")
def singles(parrot_server: ParrotServer) -> list[str]:
    """One plain invoke per prompt: what every other path must reproduce."""
    model = _llm(parrot_server)
    return [model.invoke(p) for p in PROMPTS]


class Recorder(BaseCallbackHandler):
    """Records what the callback manager sees."""

    def __init__(self) -> None:
        self.starts: list[list[str]] = []
        self.tokens: list[str] = []
        self.ends: list = []

    def on_llm_start(self, serialized, prompts, **kwargs) -> None:
        self.starts.append(prompts)

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response, **kwargs) -> None:
        self.ends.append(response)


class AsyncRecorder(AsyncCallbackHandler):
    """Records tokens from the async callback manager."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_invoke_returns_text_and_generate_reports_usage(llm: ParrotLLM, singles: list[str]) -> None:
    assert all(isinstance(t, str) and t.strip() for t in singles)
    result = llm.generate([PROMPTS[0]])
    assert result.generations[0][0].text == singles[0]  # greedy: the same both times
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result.llm_output["model_name"] == llm.model
    assert result.generations[0][0].generation_info["finish_reason"] in ("length", "stop")


def test_batch_equals_one_invoke_per_prompt_in_order(llm: ParrotLLM, singles: list[str]) -> None:
    assert llm.batch(PROMPTS) == singles


async def test_abatch_and_ainvoke_equal_the_sync_results(
    llm: ParrotLLM, singles: list[str]
) -> None:
    assert await llm.ainvoke(PROMPTS[0]) == singles[0]
    assert await llm.abatch(PROMPTS) == singles


def test_stream_joins_to_the_invoke_text_and_feeds_callbacks(
    llm: ParrotLLM, singles: list[str]
) -> None:
    recorder = Recorder()
    pieces = list(llm.stream(PROMPTS[1], config={"callbacks": [recorder]}))
    assert len(pieces) > 2  # token by token, plus the closing empty chunk
    assert "".join(pieces) == singles[1]
    assert recorder.tokens == pieces
    assert recorder.starts == [[PROMPTS[1]]]
    info = recorder.ends[0].generations[0][0].generation_info
    assert info["model_name"] == llm.model and info["token_usage"]["completion_tokens"] >= 1


async def test_astream_joins_to_the_invoke_text_and_feeds_callbacks(
    llm: ParrotLLM, singles: list[str]
) -> None:
    recorder = AsyncRecorder()
    pieces = [p async for p in llm.astream(PROMPTS[1], config={"callbacks": [recorder]})]
    assert "".join(pieces) == singles[1]
    assert recorder.tokens == pieces


def test_generate_with_callbacks_reports_start_and_end_per_prompt(llm: ParrotLLM) -> None:
    recorder = Recorder()
    llm.generate(PROMPTS[:2], callbacks=[recorder])
    assert sorted(p for start in recorder.starts for p in start) == sorted(PROMPTS[:2])
    assert len(recorder.ends) == 2


def test_stop_cuts_the_text_before_the_stop_sequence(llm: ParrotLLM, singles: list[str]) -> None:
    full = singles[0]
    stop = full.strip().split()[1]  # a word the greedy continuation does reach
    cut = llm.invoke(PROMPTS[0], stop=[stop])
    assert stop not in cut and full.startswith(cut)
    result = llm.generate([PROMPTS[0]], stop=[stop])
    assert result.generations[0][0].generation_info["finish_reason"] == "stop"
    streamed = "".join(llm.stream(PROMPTS[0], stop=[stop]))
    assert streamed == cut


@pytest.mark.parametrize("cls", [ParrotLLM, ChatParrot])
def test_a_wrong_key_is_an_authentication_error(cls, parrot_server: ParrotServer) -> None:
    model = cls(base_url=parrot_server.url, api_key="sk-wrong", max_tokens=4)
    with pytest.raises(ParrotAuthenticationError) as info:
        model.invoke("Hi")
    assert info.value.status_code == 401 and info.value.message


@pytest.mark.parametrize("cls", [ParrotLLM, ChatParrot])
def test_an_unknown_model_is_a_bad_request_with_the_server_message(
    cls, parrot_server: ParrotServer
) -> None:
    model = cls(
        base_url=parrot_server.url, api_key=parrot_server.api_key, model="gpt-9", max_tokens=4
    )
    with pytest.raises(ParrotBadRequestError, match="gpt-9") as info:
        model.invoke("Hi")
    assert info.value.status_code == 404


def test_an_invalid_parameter_names_it(llm: ParrotLLM) -> None:
    with pytest.raises(ParrotBadRequestError, match="temperature") as info:
        llm.invoke("Hi", temperature=5)
    assert info.value.status_code == 400 and info.value.param == "temperature"


def test_a_prompt_beyond_the_context_is_a_bad_request(llm: ParrotLLM) -> None:
    with pytest.raises(ParrotBadRequestError, match="context length") as info:
        llm.invoke("parrot " * 9000)
    assert info.value.code == "context_length_exceeded"


def test_no_server_is_a_connection_error() -> None:
    model = ParrotLLM(base_url="http://127.0.0.1:9", max_retries=0)
    with pytest.raises(ParrotConnectionError, match="127.0.0.1:9"):
        model.invoke("Hi")


def test_a_sampled_stream_joins_to_the_invoke_even_with_unicode_line_separators(
    parrot_server: ParrotServer,
) -> None:
    # with this seed SmolLM2 writes U+2028 as its second token (on the CPU this was found
    # on): the server sends it raw in the SSE JSON, where httpx's iter_lines broke the line
    sampled = ParrotLLM(
        base_url=parrot_server.url,
        api_key=parrot_server.api_key,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        timeout=120,
    )
    prompt = "Write a word about sky:"
    assert "".join(sampled.stream(prompt)) == sampled.invoke(prompt)
