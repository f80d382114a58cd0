"""Auth: every route but the open ones needs a valid Bearer key; auth may be off only on
loopback; the key lookup is pluggable."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.auth import OPEN_PATHS
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import API_KEY


def _concrete(path: str) -> str:
    return path.replace("{model_id}", "fake-model")


def _protected_routes(app) -> list[tuple[str, str]]:
    """Every documented operation outside the open paths (new routes are covered as they
    are added)."""
    out = []
    for path, ops in app.openapi()["paths"].items():
        if path not in OPEN_PATHS:
            out.extend((method.upper(), _concrete(path)) for method in ops)
    return out


async def test_every_route_but_open_ones_requires_a_key(app):
    routes = _protected_routes(app)
    assert ("GET", "/metrics") in routes and ("POST", "/v1/chat/completions") in routes
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as anon:
        for method, path in routes:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {API_KEY}"},
                {"Authorization": "Bearer "},
            ):
                r = await anon.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"].startswith("Bearer")
        # default deny: unknown paths do not reveal whether they exist
        assert (await anon.get("/v1/nothing-here")).status_code == 401
        for path in ("/healthz", "/openapi.json", "/docs"):
            assert (await anon.get(path)).status_code == 200, path


async def test_two_authorization_headers_are_refused_even_if_one_is_valid(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as anon:
        for pair in (
            [("authorization", f"Bearer {API_KEY}"), ("authorization", "Bearer wrong")],
            [("authorization", "Bearer wrong"), ("authorization", f"Bearer {API_KEY}")],
            [("authorization", f"Bearer {API_KEY}"), ("authorization", f"Bearer {API_KEY}")],
        ):
            r = await anon.get("/v1/models", headers=httpx.Headers(pair))
            assert r.status_code == 401, r.text
            assert "more than one Authorization header" in r.json()["error"]["message"]
        ok = await anon.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200


async def test_valid_key_passes_and_bad_body_is_401_before_400(client, app):
    assert (await client.get("/metrics")).status_code == 200
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as anon:
        r = await anon.post("/v1/completions", content=b"{not json")
    assert r.status_code == 401  # strangers learn nothing about request parsing


@pytest.mark.parametrize("is_async", [False, True])
async def test_pluggable_key_lookup(is_async):
    seen = []

    def lookup(key):
        seen.append(key)
        return {"store-key": "carol"}.get(key)

    async def alookup(key):
        return lookup(key)

    engine = FakeEngine()
    app = create_app(engine, settings=ServerSettings(key_lookup=alookup if is_async else lookup))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        ok = await c.post(
            "/v1/completions",
            headers={"Authorization": "Bearer store-key"},
            json={"model": "fake-model", "prompt": "p", "max_tokens": 1},
        )
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer other"})
    assert ok.status_code == 200 and bad.status_code == 401
    assert seen == ["store-key", "other"]
    # the tenant from the lookup feeds the prefix-cache salt
    assert engine.fills[0][3] == app.state.parrot.salt_for("carol")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_auth_off_refused_off_loopback(host):
    with pytest.raises(ValueError, match="authentication is off"):
        ServerSettings(host=host)
    with pytest.raises(ValueError, match="authentication is off"):
        ServerSettings(host=host, api_keys={"k": "t"}, auth=False)
    settings = ServerSettings(api_keys={"k": "t"})
    settings.host = host
    settings.auth = False
    with pytest.raises(ValueError):  # create_app re-checks settings mutated after creation
        create_app(FakeEngine(), settings=settings)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.5"])
async def test_auth_off_allowed_on_loopback(host):
    app = create_app(FakeEngine(), settings=ServerSettings(host=host))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.get("/v1/models")).status_code == 200


async def test_auth_forced_on_without_keys_rejects_everyone():
    app = create_app(FakeEngine(), settings=ServerSettings(auth=True))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer x"})).status_code == 401


def test_openapi_declares_bearer_auth(app):
    schema = app.openapi()
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]
