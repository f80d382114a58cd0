"""ChatParrot against a scripted server: requests, responses, streams, errors, retries."""

from __future__ import annotations

import httpx
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from langchain_parrot import (
    ChatParrot,
    ParrotAuthenticationError,
    ParrotBadRequestError,
    ParrotConnectionError,
    ParrotRateLimitError,
    ParrotResponseError,
    ParrotServerError,
    ParrotTimeoutError,
)
from langchain_parrot.chat_models import message_to_dict

from .fakes import MODEL, FakeServer, chat_body, chat_stream, error, ok, sse, stream


def chat(server: FakeServer, **kwargs) -> ChatParrot:
    return ChatParrot(base_url="http://parrot.test", **server.clients(), **kwargs)


class Tokens(BaseCallbackHandler):
    """Records on_llm_new_token calls."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.chunks: list = []

    def on_llm_new_token(self, token: str, *, chunk=None, **kwargs) -> None:
        self.tokens.append(token)
        self.chunks.append(chunk)


def test_invoke_sends_settings_and_reads_text_usage_and_metadata() -> None:
    server = FakeServer(ok(chat_body("Hi there")))
    model = chat(
        server,
        temperature=0,
        max_tokens=12,
        top_p=0.5,
        seed=7,
        stop=["\n"],
        api_key="sk-1",
        frequency_penalty=0.4,
        presence_penalty=-0.2,
        logit_bias={42: -100, 7: 2.5},
    )
    result = model.invoke("Hello")
    body = server.bodies[0]
    assert body == {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 12,
        "top_p": 0.5,
        "seed": 7,
        "frequency_penalty": 0.4,
        "presence_penalty": -0.2,
        "logit_bias": {"42": -100, "7": 2.5},
        "stop": ["\n"],
        "messages": [{"role": "user", "content": "Hello"}],
    }
    request = server.requests[0]
    assert request.url == "http://parrot.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-1"
    assert isinstance(result, AIMessage) and result.content == "Hi there"
    assert result.usage_metadata == {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}
    assert result.response_metadata["model_name"] == MODEL
    assert result.response_metadata["finish_reason"] == "stop"


def test_unset_settings_are_left_to_the_server_and_no_key_sends_no_header() -> None:
    server = FakeServer(ok(chat_body()))
    chat(server, api_key=None).invoke("Hello")
    assert server.bodies[0] == {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    assert "authorization" not in server.requests[0].headers


def test_call_stop_and_kwargs_override_the_settings() -> None:
    server = FakeServer(ok(chat_body()))
    chat(server, stop=["a"], temperature=1.0).invoke(
        "Hi", stop=["b"], temperature=0.2, model="other"
    )
    body = server.bodies[0]
    assert (body["stop"], body["temperature"], body["model"]) == (["b"], 0.2, "other")


def test_base_url_with_v1_suffix_and_env_settings(monkeypatch) -> None:
    monkeypatch.setenv("PARROT_BASE_URL", "http://from-env:1234/v1/")
    monkeypatch.setenv("PARROT_API_KEY", "sk-env")
    server = FakeServer(ok(chat_body()))
    ChatParrot(**server.clients()).invoke("Hi")
    request = server.requests[0]
    assert request.url == "http://from-env:1234/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-env"


def test_messages_map_to_openai_roles() -> None:
    messages = [
        SystemMessage("be brief"),
        HumanMessage("hi", name="ann"),
        AIMessage("hello"),
        ToolMessage("42", tool_call_id="t1"),
        ChatMessage(role="developer", content="x"),
        HumanMessage([{"type": "text", "text": "a"}, "b"]),
    ]
    assert [message_to_dict(m) for m in messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
        {"role": "developer", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]


def test_reasoning_blocks_are_not_sent_back() -> None:
    message = AIMessage([{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "ok"}])
    assert message_to_dict(message)["content"] == [{"type": "text", "text": "ok"}]


@pytest.mark.parametrize(
    "message",
    [
        HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        ChatMessage(role="narrator", content="x"),
        FunctionMessage(name="f", content="x"),
    ],
)
def test_what_the_server_cannot_take_is_a_clear_value_error(message) -> None:
    server = FakeServer(ok(chat_body()))
    with pytest.raises(ValueError, match="ChatParrot"):
        chat(server).invoke([message])
    assert server.requests == []


def test_stream_yields_text_then_one_last_chunk_with_usage_and_metadata() -> None:
    server = FakeServer(stream(chat_stream("Hel", "lo", "!")))
    tokens = Tokens()
    chunks = list(chat(server).stream("Hi", config={"callbacks": [tokens]}))
    assert [c.content for c in chunks] == ["Hel", "lo", "!", ""]
    assert server.bodies[0]["stream"] is True
    assert server.bodies[0]["stream_options"] == {"include_usage": True}
    assert [c.usage_metadata is not None for c in chunks] == [False, False, False, True]
    assert [c.chunk_position for c in chunks] == [None, None, None, "last"]
    full = chunks[0] + chunks[1] + chunks[2] + chunks[3]
    assert full.content == "Hello!"
    assert full.usage_metadata == {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}
    assert full.response_metadata["model_name"] == MODEL
    assert full.response_metadata["finish_reason"] == "stop"
    assert tokens.tokens == ["Hel", "lo", "!", ""]  # every chunk, the last one too
    assert all(isinstance(c.message, AIMessageChunk) for c in tokens.chunks)


async def test_astream_matches_stream() -> None:
    server = FakeServer(stream(chat_stream("Hel", "lo")))
    tokens = Tokens()
    chunks = [c async for c in chat(server).astream("Hi", config={"callbacks": [tokens]})]
    assert [c.content for c in chunks] == ["Hel", "lo", ""]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata is not None
    assert tokens.tokens == ["Hel", "lo", ""]


def test_streaming_true_makes_invoke_stream_and_feed_callbacks() -> None:
    server = FakeServer(stream(chat_stream("a", "b")))
    tokens = Tokens()
    result = chat(server, streaming=True).invoke("Hi", config={"callbacks": [tokens]})
    assert result.content == "ab" and server.bodies[0]["stream"] is True
    assert result.usage_metadata["total_tokens"] == 10
    assert tokens.tokens == ["a", "b", ""]


async def test_ainvoke_and_abatch() -> None:
    server = FakeServer(ok(chat_body("x")))
    model = chat(server)
    assert (await model.ainvoke("Hi")).content == "x"
    results = await model.abatch(["a", "b"])
    assert [r.content for r in results] == ["x", "x"]
    assert len(server.requests) == 3


def test_batch_sends_one_request_per_input() -> None:
    server = FakeServer(ok(chat_body("x")))
    results = chat(server).batch(["a", "b", "c"])
    assert [r.content for r in results] == ["x", "x", "x"]
    assert sorted(b["messages"][0]["content"] for b in server.bodies) == ["a", "b", "c"]


def test_identifying_params_hold_what_changes_the_output() -> None:
    params = ChatParrot(
        temperature=0.3,
        max_tokens=5,
        top_p=0.9,
        seed=1,
        stop=["x"],
        base_url="http://h:1",
        frequency_penalty=0.5,
        logprobs=True,
    )._identifying_params
    assert params == {
        "model": MODEL,
        "base_url": "http://h:1",
        "temperature": 0.3,
        "max_tokens": 5,
        "top_p": 0.9,
        "seed": 1,
        "frequency_penalty": 0.5,
        "presence_penalty": None,
        "logit_bias": None,
        "stop": ["x"],
        "logprobs": True,
        "top_logprobs": None,
    }


def test_ls_params() -> None:
    params = ChatParrot(temperature=0.3, max_tokens=5, stop=["x"])._get_ls_params()
    assert params == {
        "ls_provider": "parrot",
        "ls_model_name": MODEL,
        "ls_model_type": "chat",
        "ls_temperature": 0.3,
        "ls_max_tokens": 5,
        "ls_stop": ["x"],
    }


# ---- errors ----


def test_401_is_an_authentication_error_with_the_server_message() -> None:
    server = FakeServer(error(401, "invalid API key", type="authentication_error"))
    with pytest.raises(ParrotAuthenticationError, match="invalid API key") as info:
        chat(server).invoke("Hi")
    assert info.value.status_code == 401
    assert len(server.requests) == 1  # not retried


def test_400_names_the_parameter_and_is_not_retried() -> None:
    server = FakeServer(error(400, "temperature must be <= 2", param="temperature"))
    with pytest.raises(ParrotBadRequestError, match=r"temperature must be <= 2.*temperature"):
        chat(server).invoke("Hi")
    assert len(server.requests) == 1


def test_404_unknown_model_is_a_bad_request() -> None:
    server = FakeServer(error(404, "The model 'x' does not exist", type="not_found_error"))
    with pytest.raises(ParrotBadRequestError, match="does not exist") as info:
        chat(server, model="x").invoke("Hi")
    assert info.value.status_code == 404 and info.value.type == "not_found_error"


def test_429_is_retried_then_succeeds() -> None:
    busy = error(
        429, "too many requests in flight", type="rate_limit_error", headers={"Retry-After": "0"}
    )
    server = FakeServer(busy, busy, ok(chat_body("done")))
    assert chat(server, max_retries=2).invoke("Hi").content == "done"
    assert len(server.requests) == 3


def test_429_after_all_retries_is_a_rate_limit_error() -> None:
    server = FakeServer(
        error(429, "too many", type="rate_limit_error", headers={"Retry-After": "0"})
    )
    with pytest.raises(ParrotRateLimitError, match="too many"):
        chat(server, max_retries=1).invoke("Hi")
    assert len(server.requests) == 2


def test_503_is_retried_and_a_stream_is_retried_before_it_starts() -> None:
    down = error(
        503, "engine stopped", type="service_unavailable_error", headers={"Retry-After": "0"}
    )
    server = FakeServer(down, stream(chat_stream("ok")))
    assert "".join(c.text for c in chat(server).stream("Hi")) == "ok"
    assert len(server.requests) == 2


def test_500_with_a_non_json_body_keeps_its_text() -> None:
    server = FakeServer(httpx.Response(500, text="<html>proxy exploded</html>"))
    with pytest.raises(ParrotServerError, match="proxy exploded"):
        chat(server, max_retries=0).invoke("Hi")


def test_connect_errors_are_retried_then_a_connection_error(monkeypatch) -> None:
    monkeypatch.setattr("langchain_parrot._http.retry_delay", lambda response, attempt: 0.0)
    server = FakeServer(httpx.ConnectError("refused"))
    with pytest.raises(ParrotConnectionError, match="cannot reach http://parrot.test"):
        chat(server, max_retries=2).invoke("Hi")
    assert len(server.requests) == 3


def test_a_read_timeout_is_a_timeout_error_and_not_retried() -> None:
    server = FakeServer(httpx.ReadTimeout("slow"))
    with pytest.raises(ParrotTimeoutError, match="within 5.0 s"):
        chat(server, timeout=5.0).invoke("Hi")
    assert len(server.requests) == 1


async def test_async_errors_match_sync() -> None:
    server = FakeServer(error(401, "no key", type="authentication_error"))
    with pytest.raises(ParrotAuthenticationError, match="no key"):
        await chat(server).ainvoke("Hi")
    server = FakeServer(httpx.ReadTimeout("slow"))
    with pytest.raises(ParrotTimeoutError):
        await chat(server).ainvoke("Hi")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": MODEL, "choices": []},
        {"model": MODEL, "choices": [{"index": 0}]},
        {"model": MODEL, "choices": [{"message": {"content": 3}}]},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_body_is_a_response_error_never_a_key_error(body) -> None:
    server = FakeServer(httpx.Response(200, json=body))
    with pytest.raises(ParrotResponseError, match="malformed chat completion"):
        chat(server).invoke("Hi")


def test_a_body_that_is_not_json_is_a_response_error() -> None:
    server = FakeServer(httpx.Response(200, text="hello"))
    with pytest.raises(ParrotResponseError, match="not JSON"):
        chat(server).invoke("Hi")


def test_an_error_payload_mid_stream_raises_after_the_text_so_far() -> None:
    text = {"model": MODEL, "choices": [{"index": 0, "delta": {"content": "partial"}}]}
    failure = {
        "error": {
            "message": "engine died",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
    }
    server = FakeServer(stream(sse(text, failure)))
    seen = []
    with pytest.raises(ParrotServerError, match="engine died"):
        for chunk in chat(server).stream("Hi"):
            seen.append(chunk.text)
    assert seen == ["partial"]


@pytest.mark.parametrize(
    "body, match",
    [
        (sse("not json"), "not JSON"),
        (sse('["a list"]'), "not a JSON object"),
        (sse({"choices": []}), "malformed chat stream chunk"),
        (chat_stream("x").replace(b"data: [DONE]\n\n", b""), r"before `data: \[DONE\]`"),
    ],
)
def test_a_malformed_stream_is_a_response_error(body, match) -> None:
    server = FakeServer(stream(body))
    with pytest.raises(ParrotResponseError, match=match):
        list(chat(server).stream("Hi"))
