"""Bounds of the native API: generation configs beyond the model (vocabulary, context),
programs beyond `max_calls_per_run`, tenants beyond `max_calls_per_tenant` calls in
flight (429 with Retry-After), and cancelled calls recorded as cancelled in the store.

Before: `top_k: 10**12`, `stop_token_ids: [10**12]` and `max_tokens: 10**30` were
accepted and failed only at run time; a program of 10,000 calls was accepted and starved
every other tenant; a cancelled run's calls stayed `running` in the store."""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.manager.manager import ManagerConfig
from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import BOB, native_app, run_body, sse_events


def _engine(**kw) -> ScriptedEngine:
    engine = ScriptedEngine(reply=lambda prompt: "ok", **kw)
    engine.vocab_size = 257  # what the manager reads of a real engine
    engine.max_model_len = 1000
    return engine


def gen(**config) -> dict:
    return run_body({"name": "c", "template": "Q {{output:y}}", "outputs": {"y": config}})


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"top_k": 10**12}, "top_k"),
        ({"top_k": 258}, "vocabulary size 257"),
        ({"stop_token_ids": [10**12]}, "stop_token_ids"),
        ({"stop_token_ids": [5, 257]}, "outside the vocabulary"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": 1001}, "context of 1000"),
    ],
)
async def test_configs_beyond_the_model_are_400s_naming_call_and_output(tmp_path, config, says):
    async with native_app(tmp_path, engine=_engine()) as (c, _):
        r = await c.post("/v1/runs", json=gen(**config))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert says in message and "'c'" in message and "'y'" in message, message
        ok = await c.post("/v1/runs", json=gen(top_k=257, max_tokens=1000, stop_token_ids=[256]))
        assert ok.status_code == 201, ok.text
        # open runs: calls added later are checked the same way
        rid = (
            await c.post("/v1/runs", json=run_body({"template": "P {{output:p}}"}, open=True))
        ).json()["run_id"]
        r = await c.post(
            f"/v1/runs/{rid}/calls",
            json={"calls": [{"name": "d", "template": "Q {{output:z}}", "outputs": {"z": config}}]},
        )
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


async def test_programs_beyond_max_calls_per_run_are_refused(tmp_path):
    config = ManagerConfig(max_calls_per_run=5)
    async with native_app(tmp_path, manager_config=config) as (c, _):
        calls = [{"template": f"Q{i} {{{{output:o{i}}}}}"} for i in range(6)]
        r = await c.post("/v1/runs", json=run_body(*calls))
        assert r.status_code == 400 and "at most 5" in r.json()["error"]["message"], r.text
        r = await c.post("/v1/runs", json=run_body(*calls[:5]))
        assert r.status_code == 201
        rid = (await c.post("/v1/runs", json=run_body(*calls[:4], open=True))).json()["run_id"]
        more = [{"template": f"R{i} {{{{output:p{i}}}}}"} for i in range(2)]
        r = await c.post(f"/v1/runs/{rid}/calls", json={"calls": more})
        assert r.status_code == 400 and "at most 5" in r.json()["error"]["message"], r.text
        r = await c.post(f"/v1/runs/{rid}/calls", json={"calls": more[:1]})
        assert r.status_code == 200, r.text


async def test_a_tenant_over_its_share_gets_429_and_others_still_run(tmp_path):
    gate = asyncio.Event()
    config = ManagerConfig(max_calls_per_tenant=6)
    engine = _engine(gate=gate)
    async with native_app(tmp_path, engine=engine, manager_config=config) as (c, rt):
        four = run_body(*[{"template": f"Q{i} {{{{output:o{i}}}}}"} for i in range(4)])
        assert (await c.post("/v1/runs", json=four)).status_code == 201
        r = await c.post("/v1/runs", json=four)  # 4 + 4 > 6
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1" and "at most 6" in r.json()["error"]["message"]
        assert rt.manager.inflight("alice") == 4
        # another tenant has its own share
        bob = await c.post("/v1/runs", json=four, headers=BOB)
        assert bob.status_code == 201, bob.text
        gate.set()
        for rid in [bob.json()["run_id"]]:
            sse_events((await c.get(f"/v1/runs/{rid}/events", headers=BOB)).text)
        while rt.manager.inflight("alice"):
            await asyncio.sleep(0.01)
        assert (await c.post("/v1/runs", json=four)).status_code == 201  # room again


async def test_a_cancelled_runs_calls_are_recorded_as_cancelled(tmp_path):
    gate = asyncio.Event()
    engine = _engine(gate=gate)
    async with native_app(tmp_path, engine=engine) as (c, rt):
        chain = run_body(
            {"name": "a", "template": "Q {{output:x}}"},
            {"name": "b", "template": "{{input:x}} {{output:y}}"},
        )
        rid = (await c.post("/v1/runs", json=chain)).json()["run_id"]
        while not engine.generating:  # call a holds the gate
            await asyncio.sleep(0.01)
        r = await c.post(f"/v1/runs/{rid}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        calls = {x["name"]: x for x in (await c.get(f"/v1/runs/{rid}")).json()["calls"]}
        assert calls["a"]["status"] == "cancelled" and calls["a"]["finished_at"]
        assert calls["b"]["status"] == "cancelled"
        assert engine.contexts == {}
        assert rt.manager.inflight("alice") == 0
