"""Against a real uvicorn server on loopback: the official openai client (sync, async,
streaming), client disconnects that stop generation, and many concurrent streams."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from parrot_backend.server import ServerSettings, create_app

from .conftest import API_KEY, AUTH, KEYS, LiveServer, wait_until

REPLY = "Hello from the fake engine."
MODEL = "fake-model"


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


def test_openai_sync_completions_and_chat(live, engine):
    client = _client(live)
    assert [m.id for m in client.models.list()] == [MODEL]
    comp = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=50, temperature=0)
    assert comp.choices[0].text == REPLY and comp.choices[0].finish_reason == "stop"
    assert comp.usage.completion_tokens == len(REPLY) + 1 and comp.usage.prompt_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        seed=7,
        stop=["zzz"],
    )
    assert chat.choices[0].message.content == REPLY[:5]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"
    assert engine.generations[-1].sampling.seed == 7
    assert engine.contexts == {}


def test_openai_sync_streaming(live):
    client = _client(live)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLY) + 1
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="p", max_tokens=100, stream=True)
    ]
    assert "".join(pieces) == REPLY


async def test_openai_async_and_async_streaming(live):
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
    )
    assert chat.choices[0].message.content == REPLY
    stream = await client.completions.create(model=MODEL, prompt="p", max_tokens=8, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert text == REPLY[:8]
    await client.close()


def test_openai_errors_raise_typed_exceptions(live):
    client = _client(live)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="p")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="p", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x" * 600)
    bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_mid_stream_engine_error_raises_in_openai_client(live, engine):
    engine.fail_after = 3
    stream = _client(live).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    with pytest.raises(openai.APIError):
        list(stream)
    assert wait_until(lambda: engine.contexts == {})


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_disconnect_stops_generation(live, engine, app, endpoint):
    engine.endless = True
    engine.step_delay = 0.005
    engine.max_model_len = 200_000
    if endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    else:
        url, body = "/v1/completions", {"prompt": "x"}
    body = {**body, "model": MODEL, "stream": True, "max_tokens": 100_000}
    with httpx.stream("POST", live.url + url, json=body, headers=AUTH, timeout=10) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 10:
                break
    assert wait_until(lambda: engine.generations and engine.generations[0].closed)
    rec = engine.generations[0]
    # the engine iterator was closed and decoding stopped far short of max_tokens
    assert rec.finished is None and rec.tokens < 1000
    tokens_at_close = rec.tokens
    time.sleep(0.2)
    assert rec.tokens == tokens_at_close  # no zombie decoding
    assert wait_until(lambda: engine.contexts == {})
    assert wait_until(lambda: app.state.parrot.limiter.inflight == 0)
    assert app.state.parrot.metrics.requests_running._value.get() == 0


def test_disconnect_non_streaming_stops_generation(live, engine):
    engine.endless = True
    engine.step_delay = 0.005
    engine.max_model_len = 200_000
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100_000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    assert wait_until(lambda: engine.generations and engine.generations[0].closed)
    rec = engine.generations[0]
    assert rec.finished is None and rec.tokens < 1000
    assert wait_until(lambda: engine.contexts == {})


async def test_hundred_concurrent_streams(live, engine, app):
    engine.step_delay = 0.002
    limits = httpx.Limits(max_connections=120)
    async with httpx.AsyncClient(base_url=live.url, headers=AUTH, limits=limits, timeout=60) as c:

        async def one(i: int) -> str:
            body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 20, "stream": True}
            text = []
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                    elif line == "data: [DONE]":
                        text.append("<DONE>")
            return "".join(text)

        results = await asyncio.gather(*(one(i) for i in range(100)))
    assert all(r == REPLY[:20] + "<DONE>" for r in results)
    assert engine.contexts == {} and engine.generating == set()
    assert app.state.parrot.limiter.inflight == 0


def test_frozen_client_is_dropped_and_its_context_freed(engine):
    """A client that stops reading (but keeps the socket open) must not hold an engine
    context forever: once the send buffers fill, the send timeout ends the stream."""
    engine.endless = True
    engine.max_model_len = 1_000_000
    settings = ServerSettings(api_keys=dict(KEYS), sse_send_timeout_s=0.5)
    with LiveServer(create_app(engine, settings=settings)) as live:
        body = json.dumps(
            {"model": MODEL, "prompt": "x", "max_tokens": 900_000, "stream": True}
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", live.port))
        try:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            # never read: the server's writes back up until its send times out
            assert wait_until(
                lambda: engine.generations and engine.generations[0].closed, timeout=20
            )
            rec = engine.generations[0]
            assert rec.finished is None and rec.tokens < 900_000
            assert wait_until(lambda: engine.contexts == {})
        finally:
            sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_prefill_cancels_it(live, engine, stream):
    engine.fill_delay = 120.0  # the prompt waits in a saturated engine
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST", f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=0.3
        ) as r:
            r.read()
    assert wait_until(lambda: engine.fills_cancelled == 1)
    assert wait_until(lambda: engine.contexts == {})
    assert engine.generations == []  # nothing was generated for a client that left
