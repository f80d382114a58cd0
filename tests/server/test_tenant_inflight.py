"""A per-tenant bound on in-flight OpenAI requests (`max_inflight_per_tenant`,
`serve --max-inflight-per-tenant`): one tenant holding its share gets 429s while another
tenant is still served, a batch counts each prompt and may never exceed the share (400),
and released slots come back. Without the bound (the default) a tenant may take all."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.errors import APIError
from parrot_backend.server.limits import InflightLimiter
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import LiveServer, wait_until

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_limiter_bounds_each_tenant_and_all():
    limiter = InflightLimiter(4, retry_after_s=1, per_tenant=2)
    alice = limiter.acquire_many(2, "alice")
    with pytest.raises(APIError) as err:
        limiter.acquire("alice")
    assert err.value.status == 429 and "limit 2 per tenant" in err.value.message
    bob = limiter.acquire_many(2, "bob")
    with pytest.raises(APIError) as err:
        limiter.acquire("carol")
    assert "server busy" in err.value.message and limiter.inflight == 4
    alice[0].release()
    alice[0].release()  # idempotent
    again = limiter.acquire("alice")
    for slot in [*alice, *bob, again]:
        slot.release()
    assert limiter.inflight == 0 and limiter.by_tenant == {}
    free = InflightLimiter(4, retry_after_s=1)  # no per-tenant bound: one takes all
    assert len(free.acquire_many(4, "alice")) == 4


def test_a_tenant_at_its_share_is_refused_while_another_is_served():
    engine = FakeEngine(reply="x", endless=True, step_delay=0.05)
    settings = ServerSettings(api_keys=dict(KEYS), max_inflight_per_tenant=2, max_inflight=8)
    app = create_app(engine, settings=settings)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 500, "stream": True}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        c.post(
            "/v1/completions",
            json={**body, "stream": False, "max_tokens": 1},
            headers=_auth("sk-alice"),
        )  # (starts the fake engine's loop)
        # a batch larger than the share could never be admitted: 400
        r = c.post(
            "/v1/completions",
            json={**body, "stream": False, "prompt": ["a", "b", "c"]},
            headers=_auth("sk-alice"),
        )
        assert r.status_code == 400 and "at most 2 prompts" in r.json()["error"]["message"]
        # alice holds her two slots with two open streams
        streams = [
            c.stream("POST", "/v1/completions", json=body, headers=_auth("sk-alice"))
            for _ in range(2)
        ]
        opened = [s.__enter__() for s in streams]
        try:
            lines = [resp.iter_lines() for resp in opened]  # (kept: dropping one closes it)
            for resp, it in zip(opened, lines, strict=True):
                assert resp.status_code == 200
                assert next(it).startswith("data: ")  # generating
            r = c.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 2},
                headers=_auth("sk-alice"),
            )
            assert r.status_code == 429, r.text
            assert "per tenant" in r.json()["error"]["message"] and r.headers["retry-after"]
            r = c.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 2},
                headers=_auth("sk-bob"),
            )
            assert r.status_code == 200, r.text
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        limiter = app.state.parrot.limiter
        assert wait_until(lambda: limiter.inflight == 0), limiter.by_tenant
        r = c.post(
            "/v1/completions",
            json={**body, "stream": False, "max_tokens": 2},
            headers=_auth("sk-alice"),
        )
        assert r.status_code == 200, r.text


def test_the_bounds_on_the_command_line(capsys):
    from parrot_backend.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert (args.max_inflight, args.max_inflight_per_tenant, args.max_prompts) == (256, None, 64)
    args = parser.parse_args(
        ["serve", "--max-inflight", "32", "--max-inflight-per-tenant", "8", "--max-prompts", "4"]
    )
    assert (args.max_inflight, args.max_inflight_per_tenant, args.max_prompts) == (32, 8, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-inflight-per-tenant", "0"])
    assert "--max-inflight-per-tenant" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_inflight_per_tenant"):
        ServerSettings(max_inflight_per_tenant=0).check()
