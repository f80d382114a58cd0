"""ParrotLLM against a scripted server: requests, batches, streams, callbacks, errors."""

from __future__ import annotations

import httpx
import pytest
from langchain_core.callbacks import BaseCallbackHandler

from langchain_parrot import ParrotBadRequestError, ParrotLLM, ParrotResponseError

from .fakes import MODEL, FakeServer, completion_body, completion_stream, error, ok, stream


def llm(server: FakeServer, **kwargs) -> ParrotLLM:
    return ParrotLLM(base_url="http://parrot.test", **server.clients(), **kwargs)


def by_prompt(request: httpx.Request) -> httpx.Response:
    """Echo the prompt back, upper-cased: shows which answer belongs to which prompt."""
    import json

    prompt = json.loads(request.content)["prompt"]
    return ok(completion_body(prompt.upper()))


class Events(BaseCallbackHandler):
    """Records the LLM callbacks."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.starts = 0
        self.ends: list = []

    def on_llm_start(self, serialized, prompts, **kwargs) -> None:
        self.starts += 1

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response, **kwargs) -> None:
        self.ends.append(response)


def test_invoke_posts_the_prompt_to_completions_with_the_settings() -> None:
    server = FakeServer(ok(completion_body(" Paris.")))
    assert llm(server, temperature=0, seed=3, stop=["\n"]).invoke("Capital?") == " Paris."
    request = server.requests[0]
    assert request.url == "http://parrot.test/v1/completions"
    assert server.bodies[0] == {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 256,
        "seed": 3,
        "stop": ["\n"],
        "prompt": "Capital?",
    }


def test_generate_reports_usage_and_finish_reason() -> None:
    server = FakeServer(ok(completion_body("x")))
    result = llm(server).generate(["a"])
    assert result.llm_output == {
        "model_name": MODEL,
        "token_usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }
    assert result.generations[0][0].generation_info == {"finish_reason": "length"}


def test_batch_keeps_prompt_order_and_sums_usage() -> None:
    server = FakeServer(by_prompt)
    model = llm(server, parallel_requests=2)
    prompts = [f"p{i}" for i in range(5)]
    assert model.batch(prompts) == [p.upper() for p in prompts]
    result = model.generate(prompts)
    assert result.llm_output["token_usage"]["total_tokens"] == 50


async def test_abatch_and_ainvoke() -> None:
    server = FakeServer(by_prompt)
    model = llm(server)
    assert await model.ainvoke("one") == "ONE"
    assert await model.abatch(["a", "b", "c"]) == ["A", "B", "C"]


def test_stream_feeds_every_chunk_to_callbacks_and_ends_with_the_usage_chunk() -> None:
    server = FakeServer(stream(completion_stream("1", ",", " 2")))
    events = Events()
    pieces = list(llm(server).stream("0,", config={"callbacks": [events]}))
    assert pieces == ["1", ",", " 2", ""]
    assert events.tokens == pieces
    assert server.bodies[0]["stream"] is True
    info = events.ends[0].generations[0][0].generation_info
    assert info == {
        "finish_reason": "stop",
        "model_name": MODEL,
        "token_usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


async def test_astream_matches_stream() -> None:
    server = FakeServer(stream(completion_stream("a", "b")))
    events = Events()
    pieces = [p async for p in llm(server).astream("x", config={"callbacks": [events]})]
    assert pieces == ["a", "b", ""] and events.tokens == pieces


def test_streaming_true_makes_generate_stream_and_keeps_usage() -> None:
    server = FakeServer(stream(completion_stream("a", "b")))
    events = Events()
    result = llm(server, streaming=True).generate(["x"], callbacks=[events])
    assert result.generations[0][0].text == "ab"
    assert result.llm_output["token_usage"]["total_tokens"] == 10
    assert events.tokens == ["a", "b", ""]


def test_call_stop_replaces_the_settings_stop() -> None:
    server = FakeServer(ok(completion_body("x")))
    llm(server, stop=["a"]).invoke("p", stop=["b"])
    assert server.bodies[0]["stop"] == ["b"]


def test_a_stop_given_as_one_string_is_one_stop_sequence() -> None:
    server = FakeServer(ok(completion_body("x")))
    llm(server).invoke("p", stop="END")
    llm(server).bind(stop="\n\n").invoke("p")
    assert [b["stop"] for b in server.bodies] == [["END"], ["\n\n"]]


def test_a_bad_request_in_a_batch_raises_with_the_server_message() -> None:
    server = FakeServer(error(400, "prompt too long", param="prompt"))
    with pytest.raises(ParrotBadRequestError, match="prompt too long"):
        llm(server).batch(["a", "b"])


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "choices": []},
        {"model": MODEL, "choices": [{"index": 0}]},
        {"choices": [{"text": "x"}]},
    ],
)
def test_a_malformed_body_is_a_response_error(body) -> None:
    server = FakeServer(httpx.Response(200, json=body))
    with pytest.raises(ParrotResponseError, match="malformed completion"):
        llm(server).invoke("Hi")


def test_ls_params_and_identifying_params() -> None:
    model = ParrotLLM(temperature=0.1, stop=["z"], base_url="http://h:1")
    assert model._get_ls_params() == {
        "ls_provider": "parrot",
        "ls_model_name": MODEL,
        "ls_model_type": "llm",
        "ls_temperature": 0.1,
        "ls_max_tokens": 256,
        "ls_stop": ["z"],
    }
    assert model._identifying_params["max_tokens"] == 256
    assert model._get_ls_params(model="m2")["ls_model_name"] == "m2"
