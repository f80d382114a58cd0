"""End to end with the real in-process Engine on the tiny random Llama (SmolLM2 tokenizer
and chat template): the server's plumbing against the engine's actual contract."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from parrot_backend.server import ServerSettings, create_app

from .conftest import LiveServer, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def real_engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )


@pytest.fixture
async def real_client(real_engine):
    await real_engine.start()
    app = create_app(real_engine, settings=ServerSettings())
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        ) as c:
            yield c
    finally:
        await real_engine.stop()
    assert real_engine.contexts == {}  # every request freed its contexts


def _chat(**kw):
    return {
        "messages": [
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Name a parrot."},
        ],
        "temperature": 0,
        "max_tokens": 12,
        **kw,
    }


async def test_chat_prompt_matches_transformers_template(real_client, real_engine):
    model = real_engine.model_name
    r = await real_client.post("/v1/chat/completions", json={"model": model, **_chat()})
    assert r.status_code == 200, r.text
    expected = real_engine.tokenizer.apply_chat_template(
        _chat()["messages"], tokenize=False, add_generation_prompt=True
    )
    assert r.json()["usage"]["prompt_tokens"] == len(real_engine.tokenize(expected))
    assert r.json()["usage"]["completion_tokens"] >= 1


async def test_greedy_stream_equals_non_stream(real_client, real_engine):
    model = real_engine.model_name
    body = {
        "model": model,
        "prompt": "The parrot said",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    a = (await real_client.post("/v1/completions", json=body)).json()
    b = (await real_client.post("/v1/completions", json=body)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 10 and a["choices"][0]["finish_reason"] == "length"
    r = await real_client.post("/v1/completions", json={**body, "stream": True})
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in r.text.split("\n")
        if line.startswith("data: {")
    )
    assert text == a["choices"][0]["text"]
    assert r.text.endswith("data: [DONE]\n\n")


async def test_seeded_sampling_is_reproducible_and_n_forks(real_client, real_engine):
    model = real_engine.model_name
    body = {
        "model": model,
        "prompt": "Once upon",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 123,
        "ignore_eos": True,
    }
    a = (await real_client.post("/v1/completions", json=body)).json()
    b = (await real_client.post("/v1/completions", json=body)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    greedy = {**body, "temperature": 0, "n": 3}
    r = await real_client.post("/v1/completions", json=greedy)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # forks of one prompt agree greedily
    assert r.json()["usage"]["completion_tokens"] == 24


async def test_context_limit_and_errors_with_real_engine(real_client, real_engine):
    model = real_engine.model_name
    too_long = "parrot " * 600
    r = await real_client.post("/v1/completions", json={"model": model, "prompt": too_long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await real_client.post(
        "/v1/completions", json={"model": model, "prompt": [real_engine.vocab_size + 5]}
    )
    assert r.status_code == 400


def test_live_openai_stream_and_disconnect_with_real_engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )
    app = create_app(engine, settings=ServerSettings(manage_engine=True))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens <= 6
        # disconnect: ask for the whole context, read a little, hang up
        body = {
            "model": engine.model_name,
            "prompt": "a",
            "max_tokens": 500,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 3:
                    break
        assert wait_until(
            lambda: engine.stats_now().running == 0 and not engine.contexts, timeout=10
        )
        generated = engine.stats_now().tokens_generated
        time.sleep(0.3)
        assert engine.stats_now().tokens_generated == generated  # decoding stopped
        assert generated < 6 + 50  # far short of the 500 the stream asked for
    assert engine._task is None  # lifespan stopped the engine it owns
