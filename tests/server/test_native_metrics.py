"""/metrics exports the manager's queue and load when the app serves native runs."""

from __future__ import annotations

from .native_support import native_app, run_body
from .test_native_api import CHAIN


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_metrics_count_dispatched_calls_and_shared_prefix_use(tmp_path):
    async with native_app(tmp_path) as (c, _):
        before = (await c.get("/metrics")).text
        assert _value(before, "parrot_manager_calls_dispatched_total") == 0
        rid = (
            await c.post(
                "/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}, outputs={"z": "latency"})
            )
        ).json()["run_id"]
        assert (
            await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})
        ).status_code == 200
        after = (await c.get("/metrics")).text
    assert _value(after, "parrot_manager_calls_dispatched_total") == len(CHAIN)
    # native tokens count in the server's token total (it counted only the OpenAI routes)
    native = _value(after, "parrot_manager_tokens_generated_total")
    assert native > 0 and _value(after, "parrot_tokens_generated_total") == native
    assert _value(after, "parrot_manager_pending_calls") == 0
    assert _value(after, "parrot_manager_engines") == 1


async def test_new_work_gets_429_while_the_backlog_is_full(tmp_path):
    import asyncio

    from parrot_backend.manager.manager import ManagerConfig
    from parrot_backend.manager.policy import PolicyConfig
    from parrot_backend.server import ServerSettings
    from parrot_backend.testing.fake_engine import ScriptedEngine

    from .native_support import KEYS, echo

    gate = asyncio.Event()  # the engine holds its one call: later calls wait in the queue
    settings = ServerSettings(api_keys=dict(KEYS), max_pending_calls=2, retry_after_s=3)
    async with native_app(
        tmp_path,
        engine=ScriptedEngine(reply=echo, gate=gate),
        settings=settings,
        manager_config=ManagerConfig(policy=PolicyConfig(max_batch=1)),
    ) as (c, rt):
        statuses = []
        for _ in range(6):
            r = await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "3"
                assert "retry later" in r.json()["error"]["message"]
            await asyncio.sleep(0.05)  # let the dispatcher place what it can
        assert statuses[0] == 201 and 429 in statuses, statuses
        assert rt.manager.counts()["pending_calls"] <= 2 + 1
        assert (await c.get("/v1/runs")).status_code == 200  # reads are never refused
        gate.set()
