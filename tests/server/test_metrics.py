"""/metrics: the server's counters and histograms plus the engine's state, per-app registry."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.settings import DEFAULT_MAX_BODY_BYTES
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import AUTH


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if not s.labels else str(sorted(s.labels.items())))
            out[key] = s.value
    return out


async def test_metrics_after_traffic(client):
    for stream in (False, True):
        r = await client.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "abcd", "max_tokens": 5, "stream": stream},
        )
        assert r.status_code == 200
    await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
        },
    )
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m["parrot_tokens_generated_total"] == 13
    assert m["parrot_prompt_tokens_total"] > 8
    assert m["parrot_requests_running"] == 0
    assert m["parrot_requests_total[('endpoint', 'completions'), ('outcome', 'finished')]"] == 2
    assert m["parrot_requests_total[('endpoint', 'chat'), ('outcome', 'finished')]"] == 1
    assert m["parrot_time_to_first_token_seconds_count[('endpoint', 'completions')]"] == 2
    assert m["parrot_request_latency_seconds_count[('endpoint', 'chat')]"] == 1
    # engine state, from the (fake) engine's stats at scrape time
    assert m["parrot_engine_queue_depth"] == 3
    assert m["parrot_kv_blocks_total"] == 1000
    assert m["parrot_kv_usage_ratio"] == 0.0  # all contexts were freed
    assert m["parrot_prefix_cache_hit_tokens_total"] == 42
    assert m["parrot_prefix_cache_query_tokens_total"] == 100


async def test_each_app_has_its_own_registry():
    a = create_app(FakeEngine(), settings=ServerSettings())
    b = create_app(FakeEngine(), settings=ServerSettings())
    assert a.state.parrot.metrics.registry is not b.state.parrot.metrics.registry
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") as c:
        await c.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "p", "max_tokens": 2}
        )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=b), base_url="http://t") as c:
        m = _samples((await c.get("/metrics")).text)
    assert m["parrot_tokens_generated_total"] == 0


async def test_metrics_survive_a_broken_engine_stats(engine, settings):
    async def broken():
        raise RuntimeError("stats down")

    engine.stats = broken
    app = create_app(engine, settings=settings)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH
    ) as c:
        r = await c.get("/metrics")
        assert r.status_code == 200 and "parrot_requests_running" in r.text
        h = await c.get("/healthz")
        assert h.status_code == 503 and h.json()["error"]["message"] == "engine unavailable"


async def test_auth_and_size_rejections_are_counted(client, app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as a:
        await a.get("/v1/models")
    await client.post("/v1/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1))
    m = _samples((await client.get("/metrics")).text)
    assert m["parrot_requests_rejected_total[('reason', 'auth')]"] == 1
    assert m["parrot_requests_rejected_total[('reason', 'body_too_large')]"] == 1


async def test_healthz_reports_a_dead_engine_loop(engine, settings):
    app = create_app(engine, settings=settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/healthz")).status_code == 200
        engine.error = RuntimeError("CUDA error")  # what Engine sets when its loop dies
        assert (await c.get("/healthz")).status_code == 503
