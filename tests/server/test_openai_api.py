"""The OpenAI-compatible routes in-process: shapes, streaming framing, sampling pass-through,
context hygiene."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from parrot_backend.server import ServerSettings, create_app

from .conftest import AUTH, OTHER_KEY
from .sse_parse import parse_sse

REPLY = "Hello from the fake engine."


async def test_models(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["max_model_len"] == 512
    r = await client.get("/v1/models/fake-model")
    assert r.status_code == 200 and r.json()["id"] == "fake-model"
    r = await client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_completion_non_streaming(client, engine):
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "Say hi", "max_tokens": 100, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    ]
    # one token per character plus the EOS token
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": len(REPLY) + 1,
        "total_tokens": 6 + len(REPLY) + 1,
    }
    assert engine.contexts == {}  # freed


async def test_completion_default_max_tokens_is_16(client, engine):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == REPLY[:16]
    assert body["usage"]["completion_tokens"] == 16
    assert engine.generations[0].sampling.temperature == 1.0  # OpenAI's default


async def test_completion_token_id_prompt_and_echo(client):
    ids = list(b"abc")
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": ids, "max_tokens": 5, "echo": True},
    )
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["choices"][0]["text"] == "abc" + REPLY[:5]
    assert body["usage"]["prompt_tokens"] == 3
    r = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": [ids], "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:2]


async def test_sampling_passthrough(client, engine):
    r = await client.post(
        "/v1/completions",
        json={
            "model": "fake-model",
            "prompt": "p",
            "max_tokens": 7,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 1234,
            "stop": ["zz", "yy"],
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    s = engine.generations[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == (
        7,
        0.7,
        0.9,
        5,
        1234,
        ["zz", "yy"],
        True,
    )


@pytest.mark.parametrize("stop", ["fake", ["nope", "fake"]])
async def test_stop_string(client, stop):
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "p", "max_tokens": 100, "stop": stop},
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello from the "
    assert choice["finish_reason"] == "stop"


async def test_chat_non_streaming(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    # the default ChatML template was rendered and tokenized
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    # chat with no max_tokens may use the whole remaining context
    assert engine.generations[0].sampling.max_tokens == 512 - len(prompt.encode())


async def test_chat_uses_engine_template_and_text_parts(engine, settings):
    engine.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
        "{{ m.content }}{% endfor %}{% if add_generation_prompt %}>"
        "{% endif %}"
    )
    engine.reply = lambda prompt, sampling: "echo:" + prompt
    app = create_app(engine, settings=settings)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH
    ) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "max_tokens": 100,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            },
        )
    assert r.json()["choices"][0]["message"]["content"] == "echo:<s>[user]a\nb>"


async def test_max_completion_tokens_wins_over_max_tokens(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 50,
            "max_completion_tokens": 3,
        },
    )
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_completion_stream_framing(client, engine):
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "p", "max_tokens": 100, "stream": True},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "event:" not in r.text and "id:" not in r.text
    events = parse_sse(r.text)
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == "fake-model" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)
    assert engine.contexts == {}


async def test_chat_stream_role_first_finish_last_usage(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 100,
        },
    )
    events = parse_sse(r.text)
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY
    assert all(c["object"] == "chat.completion.chunk" for c in events[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(REPLY) + 1
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + len(REPLY) + 1
    )
    assert engine.contexts == {}


async def test_stream_stop_string_never_leaks(client):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stop": "fake",
            "max_tokens": 100,
        },
    )
    chunks = parse_sse(r.text)[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hello from the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_n_choices_fork_from_one_prompt(client, engine):
    engine.reply = lambda prompt, s: f"seed={s.seed}"
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "p", "n": 3, "seed": 10, "max_tokens": 50},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["seed=10", "seed=11", "seed=12"]
    assert r.json()["usage"]["completion_tokens"] == 3 * (len("seed=10") + 1)
    # the prompt was filled once; each choice generated in a child forked from it
    assert len(engine.fills) == 1
    root = engine.fills[0][0]
    assert {g.parent_id for g in engine.generations} == {root}
    assert engine.contexts == {}


async def test_n_choices_stream(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "n": 2,
            "stream": True,
            "max_tokens": 100,
        },
    )
    chunks = parse_sse(r.text)[:-1]
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.contexts == {}


async def test_each_request_gets_a_fresh_context_and_frees_it(client, engine):
    for _ in range(3):
        await client.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
        await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "p", "stream": True}
        )
    ids = [f[0] for f in engine.fills]
    assert len(ids) == 6 and len(set(ids)) == 6
    assert sorted(engine.freed) == sorted(ids)
    assert engine.contexts == {}


async def test_prefix_salt_is_per_tenant_and_not_client_chosen(client, engine):
    body = {"model": "fake-model", "prompt": "p", "max_tokens": 1, "salt": "attacker"}
    await client.post("/v1/completions", json=body)
    await client.post("/v1/completions", json=body)
    await client.post(
        "/v1/completions", json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"}
    )
    salts = [f[3] for f in engine.fills]
    assert salts[0] == salts[1]  # same tenant: the cache can be reused
    assert salts[2] != salts[0]  # another tenant: it cannot
    assert "attacker" not in salts and all(salts)
    assert all(g.salt in salts for g in engine.generations)


async def test_engine_error_mid_stream_becomes_error_payload(client, engine):
    from parrot_backend.contract.errors import OutOfMemory

    engine.fail_after = 3
    engine.fail_with = OutOfMemory("pool exhausted")
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "p", "max_tokens": 100, "stream": True},
    )
    events = parse_sse(r.text)
    assert "error" in events[-2]
    assert "KV cache" in events[-2]["error"]["message"]
    assert engine.contexts == {}


async def test_engine_error_non_streaming_is_openai_shaped(app, engine):
    engine.fail_after = 2
    engine.fail_with = RuntimeError("boom")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert engine.contexts == {}


async def test_unexpected_exception_is_500_in_openai_shape(engine, settings):

    def broken_tokenize(text):
        raise RuntimeError("secret internal detail")

    engine.tokenize = broken_tokenize
    app = create_app(engine, settings=settings)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "secret" not in err["message"]
        # and it keeps serving
        assert (await c.get("/v1/models")).status_code == 200


def test_healthz_open_and_minimal(engine):
    app = create_app(engine, settings=ServerSettings(api_keys={"k": "t"}))
    with TestClient(app) as c:
        r = c.get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_lifespan_starts_and_stops_owned_engine(engine):
    app = create_app(engine, settings=ServerSettings(manage_engine=True))
    with TestClient(app):
        assert engine.started and not engine.stopped
    assert engine.stopped


def test_lifespan_leaves_caller_owned_engine_alone(engine):
    with TestClient(create_app(engine, settings=ServerSettings())):
        pass
    assert not engine.started and not engine.stopped


def test_stream_json_lines_are_compact(engine):
    with TestClient(create_app(engine, settings=ServerSettings())) as c:
        r = c.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "p", "stream": True, "max_tokens": 3},
        )
    for line in r.text.split("\n"):
        if line.startswith("data: {"):
            assert json.loads(line[6:])


async def test_many_streams_leave_no_tasks_or_contexts(client, engine, app):
    """100 concurrent streams in-process, twice: afterwards no task, context or slot is
    left over, so load does not leak."""

    async def one(i: int) -> str:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "messages": [{"role": "user", "content": f"m{i}"}],
                "stream": True,
                "max_tokens": 8,
                "n": 1 + i % 2,
            },
        )
        return r.text

    tasks_after = []
    for _ in range(2):
        bodies = await asyncio.gather(*(one(i) for i in range(100)))
        assert all(b.endswith("data: [DONE]\n\n") for b in bodies)
        for _ in range(6000):  # the streams' ends are cleaned up (a loaded machine is slow)
            if not engine.contexts and app.state.parrot.limiter.inflight == 0:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert engine.contexts == {} and engine.generating == set()
        assert app.state.parrot.limiter.inflight == 0
        tasks_after.append(len(asyncio.all_tasks()))
    # the first round may start sse-starlette's one-per-loop shutdown watcher; after that
    # the task count must not grow
    assert tasks_after[1] <= tasks_after[0] <= 3


async def test_stopped_or_dead_engine_is_503_not_500(client, engine, app):
    from parrot_backend.contract.errors import EngineError

    async def dead_fill(*args, **kwargs):
        raise EngineError("engine not started: await engine.start() first")

    engine.fill = dead_fill
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert "start()" not in r.json()["error"]["message"]
    assert app.state.parrot.limiter.inflight == 0
