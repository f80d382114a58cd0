"""EngineRegistry with real engine processes: two engines register (retrying until the
manager is up) and heartbeat; SIGKILL on one removes it after missed heartbeats and calls
`on_removed`; the other keeps serving. Plus the registry's own auth and validation."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from parrot_backend.contract.errors import EngineUnavailable
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engines.remote import RemoteEngine
from parrot_backend.server.engine_registry import EngineRegistry, RegisterRequest

from .conftest import LiveServer
from .test_remote_engine import ENGINE_KEY, STARTUP_S, EngineProcess

OPERATOR_KEY = "sk-operator-test"
OP = {"Authorization": f"Bearer {OPERATOR_KEY}"}


class Recorder:
    """Registry callbacks, observed from the test thread (the registry runs in uvicorn's)."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[str] = []
        self.changed = threading.Condition()

    async def on_added(self, engine_id: str, client: RemoteEngine) -> None:
        assert isinstance(client, RemoteEngine) and client.tokenize("hi")
        with self.changed:
            self.added.append(engine_id)
            self.changed.notify_all()

    def on_removed(self, engine_id: str) -> None:  # sync callbacks work too
        with self.changed:
            self.removed.append(engine_id)
            self.changed.notify_all()

    def wait(self, predicate, timeout: float = STARTUP_S) -> None:
        with self.changed:
            if not self.changed.wait_for(predicate, timeout):
                raise AssertionError(f"timed out: added={self.added} removed={self.removed}")


def registry_app(registry: EngineRegistry) -> FastAPI:
    """The wiring the server app will do: include the router, run start/stop in lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        try:
            yield
        finally:
            await registry.stop()

    app = FastAPI(lifespan=lifespan)
    app.include_router(registry.router)
    return app


async def _generate(engine: RemoteEngine, cid: str) -> list[int]:
    await engine.fill(cid, None, engine.tokenize("The registry test says"))
    tokens = [
        d.token_id
        async for d in engine.generate(cid, None, SamplingParams(max_tokens=4, ignore_eos=True))
    ]
    await engine.free(cid)
    return tokens


async def test_engines_register_heartbeat_and_expire(tiny_model_dir, tmp_path):
    recorder = Recorder()
    registry = EngineRegistry(
        operator_key=OPERATOR_KEY,
        model_name=tiny_model_dir.name,
        heartbeat_interval_s=0.5,
        max_missed=12,  # 6 s: a loaded machine may hold a live engine's heartbeat a while
        on_added=recorder.on_added,
        on_removed=recorder.on_removed,
    )
    server = LiveServer(registry_app(registry))  # port chosen, not listening yet
    procs = [
        EngineProcess(
            tiny_model_dir,
            tmp_path,
            "--manager",
            server.url,
            "--manager-key",
            OPERATOR_KEY,
            "--engine-id",
            eid,
        )
        for eid in ("e1", "e2")
    ]
    clients: list[RemoteEngine] = []
    try:
        urls = [p.wait_url() for p in procs]
        # the manager comes up only now: the engines retry until it answers
        with server:
            recorder.wait(lambda: sorted(recorder.added) == ["e1", "e2"])
            assert set(registry.engines) == {"e1", "e2"}
            async with httpx.AsyncClient(
                base_url=server.url, headers=OP, trust_env=False, timeout=20
            ) as http:
                listed = (await http.get("/v1/engines")).json()
            assert {e["engine_id"]: e["url"] for e in listed} == {"e1": urls[0], "e2": urls[1]}

            clients = [await RemoteEngine.connect(u, api_key=ENGINE_KEY) for u in urls]
            first = await _generate(clients[0], "c1")
            assert await _generate(clients[1], "c1") == first  # same model, same tokens

            # a generation in flight when its engine dies fails fast, as unavailable
            await clients[0].fill("long", None, clients[0].tokenize("on and on"))
            stream = clients[0].generate(
                "long", None, SamplingParams(max_tokens=400, ignore_eos=True)
            )
            await anext(stream)
            procs[0].kill(signal.SIGKILL)
            with pytest.raises(EngineUnavailable):
                async with asyncio.timeout(STARTUP_S):
                    async for _ in stream:
                        pass
            recorder.wait(lambda: recorder.removed == ["e1"])
            assert set(registry.engines) == {"e2"}
            with pytest.raises(EngineUnavailable):
                await clients[0].stats()
            # the survivor still serves, and is still registered and heartbeating
            assert await _generate(clients[1], "c2") == first
            assert procs[1].proc.poll() is None
            assert registry.heartbeat("e2") and not registry.heartbeat("e1")
            # a graceful shutdown deregisters at once and exits 0
            procs[1].kill(signal.SIGTERM)
            assert procs[1].proc.returncode == 0, procs[1].stderr()
            recorder.wait(lambda: recorder.removed == ["e1", "e2"])
            assert registry.engines == {}
    finally:
        for client in clients:
            await client.aclose()
        for proc in procs:
            proc.kill()


async def test_registry_routes_need_the_operator_key_and_valid_bodies(tiny_model_dir):
    recorder = Recorder()
    registry = EngineRegistry(
        operator_key=OPERATOR_KEY,
        model_name="some-model",
        on_added=recorder.on_added,
        on_removed=recorder.on_removed,
    )
    transport = httpx.ASGITransport(app=registry_app(registry))
    body = {
        "engine_id": "e1",
        "url": "http://127.0.0.1:9",
        "model_name": "some-model",
        "api_key": "k",
    }
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for method, path in [
            ("POST", "/v1/engines/register"),
            ("POST", "/v1/engines/e1/heartbeat"),
            ("DELETE", "/v1/engines/e1"),
            ("GET", "/v1/engines"),
        ]:
            assert (await http.request(method, path, json=body)).status_code == 401
            for key in ("wrong", ENGINE_KEY):
                r = await http.request(
                    method, path, json=body, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 403, (method, path)
        r = await http.post("/v1/engines/e1/heartbeat", headers=OP)
        assert r.status_code == 404 and "register again" in r.text
        assert (await http.delete("/v1/engines/e1", headers=OP)).status_code == 404
        bad = [
            {**body, "url": "ftp://x"},
            {**body, "engine_id": "a b"},
            {**body, "api_key": ""},
            {**body, "extra": 1},
            {"engine_id": "e1"},
            # refused by httpx or the socket layer at connect time: were 500s
            {**body, "url": "http://[::1"},
            {**body, "url": "http://127.0.0.1:99999"},
            {**body, "url": "http://:80"},
            {**body, "api_key": "é"},
            {**body, "api_key": "a\nb"},
        ]
        for payload in bad:
            r = await http.post("/v1/engines/register", json=payload, headers=OP)
            assert r.status_code in (400, 422), payload  # 400 under the server's handlers
        r = await http.post(
            "/v1/engines/register", headers=OP, json={**body, "model_name": "other-model"}
        )
        assert r.status_code == 409 and "some-model" in r.text
        # nothing listens on port 9: the registry cannot connect, so it refuses
        r = await http.post("/v1/engines/register", json=body, headers=OP)
        assert r.status_code == 400 and "cannot use the engine" in r.text
    assert recorder.added == [] and registry.engines == {}
    with pytest.raises(ValueError):
        EngineRegistry(operator_key="")


class FakeClient:
    """Stands in for RemoteEngine where only the registry's bookkeeping is tested."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.closed = False
        self.resets = 0

    async def reset(self) -> int:
        self.resets += 1
        return 0

    async def aclose(self) -> None:
        self.closed = True


async def test_expiry_and_reregistration_on_a_fake_clock():
    now = [0.0]
    made: list[FakeClient] = []

    async def connect(url: str, *, api_key: str) -> FakeClient:
        made.append(FakeClient("m"))
        return made[-1]

    events: list[tuple[str, str]] = []
    registry = EngineRegistry(
        operator_key="op",
        model_name="m",
        heartbeat_interval_s=1.0,
        max_missed=3,
        connect=connect,
        clock=lambda: now[0],
        on_added=lambda eid, c: events.append(("added", eid)),
        on_removed=lambda eid: events.append(("removed", eid)),
    )

    def req(eid: str) -> RegisterRequest:
        return RegisterRequest(engine_id=eid, url="http://h:1", model_name="m", api_key="k")

    await registry.register(req("a"))
    await registry.register(req("b"))
    now[0] = 2.5
    assert registry.heartbeat("b")
    now[0] = 3.5  # a: 3.5 s since its last sign of life > 3 intervals; b: 1 s
    assert await registry.expire() == ["a"]
    assert made[0].closed and not made[1].closed
    await registry.register(req("b"))  # b restarted: the old one is removed first
    assert made[1].closed and set(registry.engines) == {"b"}
    assert events == [
        ("added", "a"),
        ("added", "b"),
        ("removed", "a"),
        ("removed", "b"),
        ("added", "b"),
    ]
    await registry.stop()
    assert made[2].closed and registry.engines == {}
    assert [c.resets for c in made] == [1, 1, 1]  # every registration starts from a reset
    assert events[-1] == ("added", "b")  # stop() does not report removals
    # a failing on_added refuses the registration and closes the client
    registry.on_added = lambda eid, c: 1 / 0
    with pytest.raises(Exception, match="could not add"):
        await registry.register(req("c"))
    assert made[-1].closed and registry.engines == {}
