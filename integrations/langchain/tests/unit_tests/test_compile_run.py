"""compile_chain running against a scripted native server (`fakes.NativeServer`): batches
with failing inputs, the server's reasons, unknown models, wrappers it must accept, stream
metadata and cancellation."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import ConfigurableField

from langchain_parrot import (
    ChatParrot,
    ParrotBadRequestError,
    ParrotConnectionError,
    ParrotError,
    compile_chain,
)
from langchain_parrot import _native as native_module
from langchain_parrot import compile as compile_module

from .fakes import MODEL, NativeServer

URL = "http://parrot.test"
PROMPT = ChatPromptTemplate.from_messages([("user", "Q: {q}")])


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> NativeServer:
    """Every httpx.AsyncClient the package makes talks to a fresh NativeServer."""
    fake = NativeServer()
    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda *a, **k: real(transport=httpx.MockTransport(fake))
    )
    monkeypatch.setattr(compile_module, "_SERVED", {})
    return fake


def chat(**kwargs) -> ChatParrot:
    return ChatParrot(base_url=URL, temperature=0, max_tokens=8, **kwargs)


def test_a_batch_with_return_exceptions_fails_only_the_bad_inputs(server) -> None:
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    inputs = [{"q": "a"}, {"wrong": 1}, {"q": "FAIL"}, {"q": "b"}]
    for got in (
        chain.batch(inputs, return_exceptions=True),
        asyncio.run(chain.abatch(inputs, return_exceptions=True)),
    ):
        assert got[0] == "gen(a)" and got[3] == "gen(b)"
        assert isinstance(got[1], KeyError)  # what the plain chain's prompt raises
        assert isinstance(got[2], ParrotError) and NativeServer.FAILURE in str(got[2])
    with pytest.raises(KeyError):
        chain.batch(inputs)


def test_a_batch_the_server_refuses_as_a_whole_fails_only_the_bad_input(server) -> None:
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    inputs = [{"q": "a"}, {"q": "REFUSE"}, {"q": "b"}]
    got = chain.batch(inputs, return_exceptions=True)
    assert got[0] == "gen(a)" and got[2] == "gen(b)"
    assert isinstance(got[1], ParrotBadRequestError) and "context holds 8192" in str(got[1])
    with pytest.raises(ParrotBadRequestError):
        chain.batch(inputs)
    with pytest.raises(ParrotBadRequestError):
        chain.invoke({"q": "REFUSE"})


def test_a_failed_call_raises_the_servers_reason(server) -> None:
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    with pytest.raises(ParrotError, match="would hold 9031 tokens"):
        chain.invoke({"q": "FAIL"})


def test_a_model_the_server_does_not_serve_is_refused_before_any_run(server) -> None:
    chain = compile_chain(PROMPT | chat(model="gpt-4") | StrOutputParser())
    with pytest.raises(ParrotBadRequestError, match="'gpt-4' does not exist") as info:
        chain.invoke({"q": "a"})
    assert info.value.status_code == 404 and info.value.param == "model"
    assert server.paths == ["GET /v1/models"]


def test_an_unreachable_server_is_a_connection_error(monkeypatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda *a, **k: real(transport=httpx.MockTransport(refuse))
    )
    monkeypatch.setattr(compile_module, "_SERVED", {})
    for model in (chat(), ChatParrot(base_url=URL)):  # with and without max_tokens
        with pytest.raises(ParrotConnectionError, match="cannot reach"):
            compile_chain(PROMPT | model).invoke({"q": "a"})


def test_fallbacks_retries_and_configurable_fields_compile(server) -> None:
    bad = chat(model="nope")
    fallback = compile_chain(PROMPT | bad.with_fallbacks([chat()]) | StrOutputParser())
    assert fallback.invoke({"q": "a"}) == "chat(Q: a)"  # on the client, as plain
    retry = compile_chain(PROMPT | chat().with_retry(stop_after_attempt=2) | StrOutputParser())
    assert retry.invoke({"q": "a"}) == "chat(Q: a)"
    configurable = chat().configurable_fields(max_tokens=ConfigurableField(id="mt"))
    compiled = compile_chain(PROMPT | configurable | StrOutputParser())
    assert compiled.invoke({"q": "a"}, config={"configurable": {"mt": 3}}) == "gen(a)"
    [run] = server.bodies("/v1/runs")
    [call] = run["program"]["calls"]
    assert call["outputs"][next(iter(call["outputs"]))]["max_tokens"] == 3  # lowered


def test_metadata_of_a_chat_answer_matches_chat_parrots(server) -> None:
    chain = compile_chain(PROMPT | chat())
    message = chain.invoke({"q": "a"})
    assert message.response_metadata == {
        "model_name": MODEL,
        "token_usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        "finish_reason": "stop",
        "model_provider": "parrot",
    }
    chunks = list(chain.stream({"q": "a"}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.content == "gen(a)"
    assert merged.usage_metadata == {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
    assert merged.response_metadata["finish_reason"] == "stop"
    assert merged.response_metadata["model_name"] == MODEL
    assert chunks[-1].chunk_position == "last"


def test_leaving_a_sync_stream_early_cancels_the_run(server) -> None:
    server.delay = 0.05
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    for _ in chain.stream({"q": "a" * 40}):
        break
    assert f"POST /v1/runs/{NativeServer.RUN_ID}/cancel" in server.paths


def test_a_batch_gives_each_input_its_own_config_and_chain_run(server) -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    class Runs(BaseCallbackHandler):
        def __init__(self) -> None:
            self.chains: list = []
            self.chat_models = 0

        def on_chain_start(self, serialized, inputs, *, parent_run_id=None, **kw) -> None:
            if parent_run_id is None:
                self.chains.append(inputs)

        def on_chat_model_start(self, serialized, messages, **kw) -> None:
            self.chat_models += 1

    configurable = chat().configurable_fields(max_tokens=ConfigurableField(id="mt"))
    chain = compile_chain(PROMPT | configurable | StrOutputParser())
    seen = [Runs(), Runs()]
    configs = [{"callbacks": [seen[0]], "configurable": {"mt": 3}}, {"callbacks": [seen[1]]}]
    assert chain.batch([{"q": "a"}, {"q": "b"}], config=configs) == ["gen(a)", "gen(b)"]
    assert [r.chains for r in seen] == [[{"q": "a"}], [{"q": "b"}]]  # one chain run each
    assert [r.chat_models for r in seen] == [1, 1]  # its own call, traced under it
    [run] = server.bodies("/v1/runs")  # one server run for both
    budgets = [next(iter(c["outputs"].values()))["max_tokens"] for c in run["program"]["calls"]]
    assert budgets == [3, 8]


def test_on_llm_end_of_a_lowered_step_carries_usage_as_the_models_own_does(server) -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    from langchain_parrot import ParrotLLM

    class Ends(BaseCallbackHandler):
        def __init__(self) -> None:
            self.results: list = []

        def on_llm_end(self, response, **kw) -> None:
            self.results.append(response)

    ends = Ends()
    llm = ParrotLLM(base_url=URL, temperature=0, max_tokens=8)
    chain = compile_chain(PROMPT | chat() | StrOutputParser() | PROMPT | llm)
    chain.invoke({"q": "a"}, config={"callbacks": [ends]})
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert [r.llm_output for r in ends.results] == [{"model_name": MODEL, "token_usage": usage}] * 2
    for r in ends.results:
        assert r.generations[0][0].generation_info == {"finish_reason": "stop"}


def test_history_with_tool_calls_or_names_is_sent_as_chat_parrot_sends_it(server) -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.prompts import MessagesPlaceholder

    prompt = ChatPromptTemplate.from_messages([MessagesPlaceholder("history"), ("user", "{q}")])
    chain = compile_chain(prompt | chat() | StrOutputParser())
    call = {"name": "add", "args": {"a": 1}, "id": "call_1"}
    for history in ([AIMessage("", tool_calls=[call])], [HumanMessage("hi", name="ada")]):
        server.requests.clear()
        chain.invoke({"history": history, "q": "go on"})
        posts = [p for p in server.paths if p.startswith("POST")]
        assert posts == ["POST /v1/chat/completions"]  # request-level, as plain
        [sent] = server.bodies("/v1/chat/completions")
        assert "tool_calls" in sent["messages"][0] or sent["messages"][0]["name"] == "ada"


def test_a_model_the_server_did_not_list_before_is_looked_up_again(server) -> None:
    compile_module._SERVED[URL] = {"other-model": 2048}  # read before a restart
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    assert chain.invoke({"q": "a"}) == "gen(a)"
    assert server.paths == ["GET /v1/models", "POST /v1/runs"]
    chain.invoke({"q": "a"})
    assert server.paths.count("GET /v1/models") == 1  # listed now: not read again


def test_a_run_request_that_could_not_connect_is_sent_again(server, monkeypatch) -> None:
    """A connection refused before the request was sent is retried (max_retries), as the
    request-level routes retry it; one that may have reached the server is not."""
    monkeypatch.setattr(native_module, "retry_delay", lambda *a: 0.0)
    answer = server.__class__.__call__
    refusals = {"n": 1}

    def flaky(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/runs" and refusals["n"]:
            refusals["n"] -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return answer(self, request)

    monkeypatch.setattr(server.__class__, "__call__", flaky)
    chain = compile_chain(PROMPT | chat() | StrOutputParser())
    assert chain.invoke({"q": "a"}) == "gen(a)"
    assert server.paths.count("POST /v1/runs") == 1  # the refused one never arrived
    refusals["n"] = 5  # more than max_retries (2): the error reaches the caller
    with pytest.raises(ParrotConnectionError):
        chain.invoke({"q": "a"})
