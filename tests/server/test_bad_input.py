"""Bad input never yields a 5xx: each case gets a 4xx with an OpenAI-shaped error that
says what is wrong, and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import AUTH, KEYS

C = "/v1/completions"
CH = "/v1/chat/completions"
OK_C = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
OK_CH = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG = "x" * 600  # the fake engine's context is 512 tokens (one per byte)


def c(**kw):
    return {**OK_C, **kw}


def ch(**kw):
    return {**OK_CH, **kw}


def raw(text: str) -> bytes:
    return text.encode()


# (id, path, body (dict -> JSON, bytes -> raw), expected status, words the message must hold)
CASES = [
    ("malformed-json", C, raw('{"model": '), 400, "malformed json"),
    ("malformed-json-chat", CH, raw("{'single': 'quotes'}"), 400, "malformed json"),
    ("trailing-garbage", C, raw(json.dumps(OK_C) + "}"), 400, "malformed json"),
    ("empty-body", C, b"", 400, "body"),
    ("json-array-body", C, raw("[1, 2]"), 400, "object"),
    ("json-string-body", CH, raw('"hello"'), 400, "object"),
    ("json-null-body", C, raw("null"), 400, "body"),
    ("nan-temperature", C, raw(json.dumps(c(temperature=float("nan")))), 400, "temperature"),
    ("nan-temperature-chat", CH, raw(json.dumps(ch(temperature=float("nan")))), 400, "temperature"),
    ("inf-temperature", C, raw(json.dumps(c(temperature=float("inf")))), 400, "temperature"),
    ("neg-inf-top-p", CH, raw(json.dumps(ch(top_p=float("-inf")))), 400, "top_p"),
    ("nan-top-p", C, raw(json.dumps(c(top_p=float("nan")))), 400, "top_p"),
    ("negative-temperature", C, c(temperature=-0.5), 400, "temperature"),
    ("huge-temperature", CH, ch(temperature=1e9), 400, "temperature"),
    ("string-temperature", C, c(temperature="hot"), 400, "temperature"),
    ("numeric-string-temperature", C, c(temperature="0.5"), 400, "temperature"),
    ("bool-temperature", C, c(temperature=True), 400, "temperature"),
    ("top-p-zero", C, c(top_p=0), 400, "top_p"),
    ("top-p-above-one", CH, ch(top_p=1.5), 400, "top_p"),
    ("negative-top-k", C, c(top_k=-1), 400, "top_k"),
    ("top-k-above-vocab", C, c(top_k=10**6), 400, "top_k"),
    ("max-tokens-zero", C, c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CH, ch(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-float", C, c(max_tokens=3.5), 400, "max_tokens"),
    ("max-tokens-string", C, c(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-beyond-context", C, c(max_tokens=10_000), 400, "maximum context length"),
    (
        "max-completion-tokens-beyond-context",
        CH,
        ch(max_completion_tokens=10_000),
        400,
        "maximum context length",
    ),
    ("max-completion-tokens-zero", CH, ch(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("prompt-beyond-context", C, c(prompt=LONG), 400, "maximum context length"),
    (
        "chat-beyond-context",
        CH,
        ch(messages=[{"role": "user", "content": LONG}]),
        400,
        "maximum context length",
    ),
    ("prompt-ids-beyond-context", C, c(prompt=[1] * 600), 400, "maximum context length"),
    ("huge-max-tokens-int", C, c(max_tokens=10**30), 400, "max_tokens"),
    ("seed-negative", C, c(seed=-1), 400, "seed"),
    ("seed-too-big", CH, ch(seed=2**70), 400, "seed"),
    ("seed-string", C, c(seed="abc"), 400, "seed"),
    ("n-zero", C, c(n=0), 400, "n"),
    ("n-too-many", CH, ch(n=100), 400, "n must be <="),
    ("stop-empty-string", C, c(stop=""), 400, "stop"),
    ("stop-list-with-empty", CH, ch(stop=["ok", ""]), 400, "stop"),
    ("stop-wrong-type", C, c(stop=5), 400, "stop"),
    ("stop-list-of-ints", C, c(stop=[1, 2]), 400, "stop"),
    ("too-many-stops", C, c(stop=[f"s{i}" for i in range(50)]), 400, "stop"),
    ("missing-model", C, {"prompt": "hi"}, 400, "model"),
    ("unknown-model", C, c(model="gpt-4"), 404, "does not exist"),
    ("unknown-model-chat", CH, ch(model="other"), 404, "does not exist"),
    ("empty-model", CH, ch(model=""), 400, "model"),
    ("model-not-string", C, c(model=42), 400, "model"),
    ("missing-prompt", C, {"model": "fake-model"}, 400, "prompt"),
    ("prompt-null", C, c(prompt=None), 400, "prompt"),
    ("prompt-number", C, c(prompt=12), 400, "prompt"),
    ("prompt-dict", C, c(prompt={"a": 1}), 400, "prompt"),
    ("prompt-empty-string", C, c(prompt=""), 400, "empty"),
    ("prompt-empty-list", C, c(prompt=[]), 400, "empty"),
    ("prompt-batched-one-empty", C, c(prompt=["a", ""]), 400, "prompt[1]: the prompt is empty"),
    ("prompt-mixed-list", C, c(prompt=["a", 1]), 400, "prompt"),
    ("prompt-token-out-of-vocab", C, c(prompt=[1, 2, 99999]), 400, "vocabulary"),
    ("prompt-token-negative", C, c(prompt=[-3]), 400, "vocabulary"),
    ("prompt-token-float", C, c(prompt=[1.5, 2.5]), 400, "prompt"),
    ("missing-messages", CH, {"model": "fake-model"}, 400, "messages"),
    ("empty-messages", CH, ch(messages=[]), 400, "messages"),
    ("messages-not-list", CH, ch(messages="hi"), 400, "messages"),
    ("message-bad-role", CH, ch(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("message-missing-role", CH, ch(messages=[{"content": "x"}]), 400, "role"),
    ("message-content-number", CH, ch(messages=[{"role": "user", "content": 5}]), 400, "content"),
    (
        "message-image-part",
        CH,
        ch(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
        "content",
    ),
    ("message-not-object", CH, ch(messages=["hello"]), 400, "messages"),
    ("stream-not-bool", C, c(stream="yes"), 400, "stream"),
    (
        "stream-options-without-stream",
        CH,
        ch(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "stream-options-wrong-type",
        CH,
        ch(stream=True, stream_options={"include_usage": "y"}),
        400,
        "include_usage",
    ),
    ("presence-penalty-out-of-range", C, c(presence_penalty=-2.5), 400, "presence_penalty"),
    ("presence-penalty-not-number", C, c(presence_penalty="high"), 400, "presence_penalty"),
    ("frequency-penalty-out-of-range", CH, ch(frequency_penalty=5), 400, "frequency_penalty"),
    ("logit-bias-key-not-id", C, c(logit_bias={"hello": 10}), 400, "logit_bias"),
    ("logit-bias-out-of-range", CH, ch(logit_bias={"50": 150}), 400, "logit_bias"),
    ("logit-bias-id-outside-vocab", C, c(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit-bias-negative-id", C, c(logit_bias={"-3": 1}), 400, "logit_bias"),
    ("logit-bias-same-id-twice", C, c(logit_bias={"5": 1, "05": 2}), 400, "logit_bias"),
    ("logit-bias-not-number", C, c(logit_bias={"5": "x"}), 400, "logit_bias"),
    ("logprobs-completions", C, c(logprobs=2), 400, "logprobs"),
    ("logprobs-chat", CH, ch(logprobs=True), 400, "logprobs"),
    ("best-of", C, c(best_of=3), 400, "best_of"),
    ("suffix", C, c(suffix="end"), 400, "suffix"),
    (
        "tool-unsupported-schema",
        CH,
        ch(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
                }
            ]
        ),
        400,
        "tools[0].function.parameters: json_schema uses keywords the grammar engine does not "
        "support: uniqueItems",
    ),
    (
        "tool-bad-name",
        CH,
        ch(tools=[{"type": "function", "function": {"name": "a b"}}]),
        400,
        "name",
    ),
    (
        "tool-duplicate-name",
        CH,
        ch(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
        400,
        "two tools are named 'f'",
    ),
    ("tool-choice", CH, ch(tool_choice="required"), 400, "tool_choice"),
    (
        "tool-choice-unknown-function",
        CH,
        ch(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "not among the tools",
    ),
    ("tool-choice-bad-string", CH, ch(tool_choice="always"), 400, "tool_choice"),
    (
        "response-format-json-schema-without-schema",
        CH,
        ch(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "needs json_schema.schema",
    ),
    (
        "response-format-unsupported-keyword",
        CH,
        ch(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {}}},
            }
        ),
        400,
        "does not support: not",
    ),
    (
        "response-format-with-stop",
        CH,
        ch(response_format={"type": "json_object"}, stop=["}"]),
        400,
        "stop strings cannot be combined",
    ),
    ("response-format-unknown", CH, ch(response_format={"type": "yaml"}), 400, "response_format"),
    (
        # NaN and 1e400 are no JSON numbers; the schema compiled to `null` before
        "response-format-schema-nan",
        CH,
        raw(
            json.dumps(OK_CH)[:-1] + ', "response_format": {"type": "json_schema", "json_schema": '
            '{"name": "x", "schema": {"const": NaN}}}}'
        ),
        400,
        "not finite",
    ),
    (
        "response-format-schema-huge-number",
        CH,
        raw(
            json.dumps(OK_CH)[:-1] + ', "response_format": {"type": "json_schema", "json_schema": '
            '{"name": "x", "schema": {"enum": [1e400]}}}}'
        ),
        400,
        "not finite",
    ),
    (
        "response-format-schema-admits-nothing",
        CH,
        ch(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#"}},
            }
        ),
        400,
        "admits no value",
    ),
    ("request-chat-template-disabled", CH, ch(chat_template="{{ 1 }}"), 400, "disabled"),
    ("user-too-long", C, c(user="u" * 10_000), 400, "user"),
    ("deeply-nested-json", C, raw("[" * 100_000 + "]" * 100_000), 400, ""),
    ("invalid-utf8-body", C, b'{"model": "fake-model", "prompt": "\xff\xfe"}', 400, ""),
    (
        "lone-surrogate-prompt",
        C,
        raw('{"model": "fake-model", "prompt": "a\\ud800b"}'),
        400,
        "unicode",
    ),
    (
        "lone-surrogate-chat",
        CH,
        raw('{"model": "fake-model", "messages": [{"role": "user", "content": "\\udfff"}]}'),
        400,
        "unicode",
    ),
]


@pytest.fixture
def battery_app():
    return create_app(FakeEngine(), settings=ServerSettings(api_keys=dict(KEYS)))


@pytest.mark.parametrize("case_id,path,body,status,words", CASES, ids=[x[0] for x in CASES])
async def test_bad_input(battery_app, case_id, path, body, status, words):
    transport = httpx.ASGITransport(app=battery_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as cl:
        if isinstance(body, bytes):
            r = await cl.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await cl.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"] and words.lower() in err["message"].lower(), err
        # and it keeps serving
        ok = await cl.post(path, json=OK_C if path == C else OK_CH)
        assert ok.status_code == 200
    assert battery_app.state.parrot.engine.contexts == {}
    assert battery_app.state.parrot.limiter.inflight == 0


def test_battery_is_large():
    assert len(CASES) >= 50


async def test_wrong_content_type_and_method(client):
    r = await client.post(C, content=json.dumps(OK_C), headers={"content-type": "text/plain"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
    r = await client.get(C)
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = await client.delete("/v1/models")
    assert r.status_code == 405


async def test_body_too_large_by_content_length(engine):
    app = create_app(engine, settings=ServerSettings(max_body_bytes=1000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as cl:
        r = await cl.post(C, json=c(prompt="x" * 2000))
        assert r.status_code == 413
        assert "too large" in r.json()["error"]["message"]
        assert (await cl.post(C, json=c(prompt="x" * 100))).status_code == 200


async def test_body_too_large_when_chunked(engine):
    app = create_app(engine, settings=ServerSettings(max_body_bytes=1000))

    async def chunks():
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'"}'

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as cl:
        r = await cl.post(C, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
    assert engine.fills == []


async def test_backpressure_429_with_retry_after():
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine, settings=ServerSettings(max_inflight=2, retry_after_s=3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as cl:
        slow = [asyncio.create_task(cl.post(C, json=c(max_tokens=30))) for _ in range(2)]
        while app.state.parrot.limiter.inflight < 2:
            await asyncio.sleep(0.005)
        r = await cl.post(C, json=c())
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert all(t.status_code == 200 for t in await asyncio.gather(*slow))
        assert (await cl.post(C, json=c())).status_code == 200  # slots came back
        metrics = (await cl.get("/metrics")).text
    assert 'parrot_requests_rejected_total{reason="overloaded"} 1.0' in metrics


def test_openapi_documents_the_error_answers_and_no_422():
    """FastAPI documents a 422 the server never sends (validation errors are 400s); the
    schema lists the statuses it does send, in the error shape it sends them."""
    for auth in (False, True):
        settings = ServerSettings(api_keys=KEYS) if auth else ServerSettings()
        schema = create_app(FakeEngine(), settings=settings).openapi()
        assert "HTTPValidationError" not in json.dumps(schema)
        error = schema["components"]["schemas"]["ErrorResponse"]
        assert error["properties"]["error"]["required"] == ["message", "type"]
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                codes = set(operation["responses"])
                assert "422" not in codes, (path, method)
                assert {"400", "404", "409", "413", "429"} <= codes, (path, method)
                assert ("401" in codes) == auth, (path, method)
