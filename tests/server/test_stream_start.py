"""A streamed request whose prompt waits in a busy engine's queue gets its response started
(headers, then pings) after `stream_start_s`, not only once its prefill ends: read timeouts
of clients and proxies do not fire while it waits (64 users of a 4,096-token prompt on the
CPU: the last request-level calls waited ~10 minutes and a 600 s client timeout fired)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from parrot_backend.contract.errors import EngineError
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import AUTH, KEYS, LiveServer, wait_until

REPLY = "Hello from the fake engine."
MODEL = "fake-model"
QUEUED = 5.0  # seconds the prompt waits in the fake engine's queue
READ_TIMEOUT = 2.5  # the client's: shorter than the wait, longer than the start + pings


def _settings(**kw) -> ServerSettings:
    return ServerSettings(api_keys=dict(KEYS), stream_start_s=0.1, sse_ping_s=0.3, **kw)


def _stream(url: str, path: str, body: dict) -> tuple[int, list[str], str]:
    """(status, data payloads, raw text) of a streamed request, under READ_TIMEOUT."""
    with httpx.stream("POST", f"{url}{path}", json=body, headers=AUTH, timeout=READ_TIMEOUT) as r:
        raw = "".join(r.iter_text())
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    return r.status_code, data, raw


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_queued_stream_starts_while_its_prompt_waits(path):
    engine = FakeEngine(fill_delay=QUEUED)
    with LiveServer(create_app(engine, settings=_settings())) as live:
        if path == "/v1/completions":
            body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 50, "stream": True}
        else:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 50,
                "stream": True,
            }
        # without the early start the client's read timeout fires before the first byte
        status, data, raw = _stream(live.url, path, body)
        assert status == 200
        assert ": ping" in raw, raw[:300]  # pings while the prompt was queued
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        key = "text" if path == "/v1/completions" else "content"
        text = "".join(
            (c["choices"][0].get(key) or c["choices"][0].get("delta", {}).get(key) or "")
            for c in chunks
            if c["choices"]
        )
        assert text == REPLY
        assert len(engine.fills) == 1 and engine.fills_cancelled == 0
        assert wait_until(lambda: engine.contexts == {})


def test_a_queued_prefill_that_fails_ends_the_stream_with_an_error_event():
    class FailingQueue(FakeEngine):
        async def fill(self, *args, **kw):
            await super().fill(*args, **kw)
            raise EngineError("the engine gave up on this prompt")

    engine = FailingQueue(fill_delay=QUEUED)
    with LiveServer(create_app(engine, settings=_settings())) as live:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
        status, data, _ = _stream(live.url, "/v1/completions", body)
        assert status == 200  # started before the failure
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["message"] and error["type"]
        assert engine.generations == []
        assert wait_until(lambda: engine.contexts == {})
        # a prefill that fails before the stream starts still gets an HTTP status
        engine.fill_delay = 0.0
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=10)
        assert r.status_code >= 400 and r.json()["error"]["message"]


def test_a_client_leaving_a_started_queued_stream_cancels_its_prefill():
    engine = FakeEngine(fill_delay=30.0)
    with LiveServer(create_app(engine, settings=_settings())) as live:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
        with httpx.stream(
            "POST", f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=10
        ) as r:
            assert r.status_code == 200  # started while the prompt is queued
            next(r.iter_raw())  # a ping
        assert wait_until(lambda: engine.fills_cancelled == 1)
        assert wait_until(lambda: engine.contexts == {})
        assert engine.generations == []


def test_a_request_that_is_not_streamed_waits_for_its_prefill():
    engine = FakeEngine(fill_delay=0.5)
    with LiveServer(create_app(engine, settings=_settings())) as live:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50}
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY


def test_stream_start_must_not_be_negative():
    with pytest.raises(ValueError, match="stream_start_s"):
        ServerSettings(stream_start_s=-1)


async def test_real_engine_streams_alike_when_every_stream_starts_before_its_prefill(
    tiny_model_dir,
):
    """stream_start_s = 0: every stream starts before its prefill ends; its tokens are the
    tokens of the same request not streamed (the tiny random Llama, greedy)."""
    from parrot_backend.engine.engine import Engine

    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )
    await engine.start()
    try:
        app = create_app(engine, settings=ServerSettings(stream_start_s=0))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        ) as c:
            model = engine.model_name
            for n in (1, 2):
                body = {
                    "model": model,
                    "prompt": "Parrots are birds that",
                    "max_tokens": 12,
                    "temperature": 0,
                    "n": n,
                }
                plain = await c.post("/v1/completions", json=body)
                assert plain.status_code == 200, plain.text
                want = [ch["text"] for ch in plain.json()["choices"]]
                streams = await asyncio.gather(
                    *(c.post("/v1/completions", json={**body, "stream": True}) for _ in range(3))
                )
                for s in streams:
                    assert s.status_code == 200
                    got = [""] * n
                    for line in s.text.splitlines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                got[ch["index"]] += ch["text"]
                    assert got == want
    finally:
        await engine.stop()
    assert engine.contexts == {}
