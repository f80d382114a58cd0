"""Log probabilities through the drop-ins against the session's real server: ChatParrot
(`logprobs`, `top_logprobs`) and ParrotLLM (`logprobs`) return the server's entries, a
stream's merged chunks carry the same entries as the invoke (greedy), and compile_chain
leaves a model that asks for them to its own request (a program's outputs are text)."""

from __future__ import annotations

import math

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from langchain_parrot import ChatParrot, ParrotLLM, compile_chain

from .conftest import ParrotServer


def _chat(server: ParrotServer, **kw) -> ChatParrot:
    return ChatParrot(
        base_url=server.url, api_key=server.api_key, temperature=0, max_tokens=6, **kw
    )


def _entries_ok(entries: list[dict], top: int) -> None:
    for e in entries:
        assert e["logprob"] <= 0 and math.isfinite(e["logprob"])
        assert len(e["top_logprobs"]) == top
        # greedy: the chosen token is the most likely one
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]


def _same(got: list[dict], want: list[dict]) -> None:
    """The same tokens with the same logprobs, but for float noise (a second request's
    prompt comes from the engine's prefix cache, computed in another batch shape)."""
    assert [e["token"] for e in got] == [e["token"] for e in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g["logprob"] - w["logprob"]) < 1e-3


def test_chat_parrot_returns_logprobs_invoked_and_streamed(parrot_server: ParrotServer) -> None:
    chat = _chat(parrot_server, logprobs=True, top_logprobs=2)
    message = chat.invoke("Name a bird.")
    entries = message.response_metadata["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == message.content
    assert len(entries) == message.usage_metadata["output_tokens"] - (
        message.response_metadata["finish_reason"] == "stop"
    )
    _entries_ok(entries, 2)
    chunks = list(chat.stream("Name a bird."))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.content == message.content
    _same(merged.response_metadata["logprobs"]["content"], entries)
    # off by default: no entries asked, none returned
    assert "logprobs" not in _chat(parrot_server).invoke("Name a bird.").response_metadata


def test_parrot_llm_returns_logprobs_generated_and_streamed(parrot_server: ParrotServer) -> None:
    llm = ParrotLLM(
        base_url=parrot_server.url,
        api_key=parrot_server.api_key,
        temperature=0,
        max_tokens=6,
        logprobs=1,
    )
    [[gen]] = llm.generate(["1, 2, 3,"]).generations
    logprobs = gen.generation_info["logprobs"]
    assert "".join(logprobs["tokens"]) == gen.text
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"])
    chunks = list(llm._stream("1, 2, 3,"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.text == gen.text
    assert merged.generation_info["logprobs"]["tokens"] == logprobs["tokens"]
    got = merged.generation_info["logprobs"]["token_logprobs"]
    assert all(abs(g - w) < 1e-3 for g, w in zip(got, logprobs["token_logprobs"], strict=True))


def test_compile_chain_leaves_a_model_asking_for_logprobs_to_its_own_request(
    parrot_server: ParrotServer,
) -> None:
    prompt = ChatPromptTemplate.from_messages([("human", "Name a {thing}.")])
    for model in (
        _chat(parrot_server, logprobs=True),
        _chat(parrot_server).bind(logprobs=True),
    ):
        chain = prompt | model
        compiled = compile_chain(chain)
        where = {s["step"]: s["where"] for s in compiled.plan()["steps"]}
        assert "server" not in where.values(), where
        got = compiled.invoke({"thing": "bird"})
        want = chain.invoke({"thing": "bird"})
        assert got.content == want.content
        _same(
            got.response_metadata["logprobs"]["content"],
            want.response_metadata["logprobs"]["content"],
        )
    # without logprobs the model step is lowered as before
    plain = compile_chain(prompt | _chat(parrot_server) | StrOutputParser())
    assert "server" in {s["where"] for s in plain.plan()["steps"]}
