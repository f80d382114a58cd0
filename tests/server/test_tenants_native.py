"""Tenants on the native API: isolation on every route, store-issued keys, and prefix
sharing only within a tenant unless the program or workflow is public."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import ALICE, BOB, echo, native_app, run_body, sse_events

CHAIN = (
    {"name": "a", "template": "Start {{input:x}} {{output:y}}"},
    {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
)
SYSTEM = "You are a careful assistant with a long enough system prompt. "
ASK = {"name": "ask", "template": SYSTEM + "{{input:q}} {{output:a}}"}


async def _done(c: httpx.AsyncClient, rid: str, headers: dict) -> None:
    events = sse_events((await c.get(f"/v1/runs/{rid}/events", headers=headers)).text)
    assert events[-1]["event"] == "run_finished"


async def test_another_tenants_run_is_not_found_on_every_route(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(CHAIN[0], open=True))).json()["run_id"]
        probes = [
            ("GET", f"/v1/runs/{rid}", None),
            ("GET", f"/v1/runs/{rid}/variables/y", None),
            ("PUT", f"/v1/runs/{rid}/variables/x", {"value": "v"}),
            ("POST", f"/v1/runs/{rid}/calls", {"calls": [CHAIN[1]]}),
            ("POST", f"/v1/runs/{rid}/close", None),
            ("POST", f"/v1/runs/{rid}/cancel", None),
            ("POST", f"/v1/runs/{rid}/replay", {}),
            ("GET", f"/v1/runs/{rid}/events", None),
        ]
        missing = "0" * 32
        for method, path, body in probes:
            theirs = await c.request(method, path, json=body, headers=BOB)
            nobody = await c.request(method, path.replace(rid, missing), json=body, headers=BOB)
            assert theirs.status_code == 404, (method, path, theirs.text)
            # indistinguishable from a run that does not exist
            assert (
                theirs.json()["error"]["message"].replace(rid, missing)
                == nobody.json()["error"]["message"]
            )
        assert (await c.get("/v1/runs", headers=BOB)).json()["runs"] == []
        # nothing bob tried changed alice's run
        assert (await c.put(f"/v1/runs/{rid}/variables/x", json={"value": "go"})).status_code == 200
        got = await c.get(f"/v1/runs/{rid}/variables/y")
        assert got.status_code == 200, got.text
        assert got.json()["value"] == "<go>"
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["run"]["status"] == "running" and len(detail["calls"]) == 1


async def test_workflows_are_per_tenant(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        program = {"calls": list(CHAIN)}
        assert (
            await c.post("/v1/workflows", json={"name": "w", "program": program})
        ).status_code == 201
        assert (await c.get("/v1/workflows", headers=BOB)).json()["workflows"] == []
        r = await c.post("/v1/workflows/w/runs", json={"inputs": {"x": "1"}}, headers=BOB)
        assert r.status_code == 404
        # bob's own workflow of the same name is his version 1
        mine = await c.post("/v1/workflows", json={"name": "w", "program": program}, headers=BOB)
        assert mine.json()["version"] == 1


async def test_store_issued_keys_authenticate_and_revoked_ones_do_not(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        _, key = rt.store.create_tenant("carol")
        carol = {"Authorization": f"Bearer {key}"}
        rid = (
            await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "c"}), headers=carol)
        ).json()["run_id"]
        assert (await c.get(f"/v1/runs/{rid}", headers=carol)).status_code == 200
        assert (await c.get(f"/v1/runs/{rid}")).status_code == 404  # alice
        assert (
            await c.get(f"/v1/runs/{rid}", headers={"Authorization": "Bearer sk-wrong"})
        ).status_code == 401
        rt.store.revoke_api_key(key)
        assert (await c.get(f"/v1/runs/{rid}", headers=carol)).status_code == 401


@pytest.mark.parametrize("public_via", ["program", "workflow"])
async def test_prefix_shared_within_a_tenant_and_across_only_when_public(
    tmp_path, public_via
) -> None:
    engine = ScriptedEngine(reply=echo)

    def system_fills() -> int:
        return sum(f.text == SYSTEM for f in engine.fills)

    async with native_app(tmp_path, engine=engine) as (c, rt):
        for q, who in (("one", ALICE), ("two", ALICE)):
            rid = (
                await c.post("/v1/runs", json=run_body(ASK, inputs={"q": q}), headers=who)
            ).json()["run_id"]
            await _done(c, rid, who)
        assert system_fills() == 1  # alice's second run forked alice's cached prefix
        rid = (
            await c.post("/v1/runs", json=run_body(ASK, inputs={"q": "three"}), headers=BOB)
        ).json()["run_id"]
        await _done(c, rid, BOB)
        assert system_fills() == 2  # bob does not get alice's prefix
        if public_via == "workflow":
            await c.post(
                "/v1/workflows", json={"name": "pub", "program": {"calls": [ASK]}, "public": True}
            )
            await c.post(
                "/v1/workflows",
                json={"name": "pub", "program": {"calls": [ASK]}, "public": True},
                headers=BOB,
            )
        for q, who in (("four", ALICE), ("five", BOB)):
            if public_via == "workflow":
                r = await c.post("/v1/workflows/pub/runs", json={"inputs": {"q": q}}, headers=who)
            else:
                r = await c.post(
                    "/v1/runs",
                    json=run_body(ASK, inputs={"q": q}, program_extra={"public": True}),
                    headers=who,
                )
            assert r.status_code == 201, r.text
            await _done(c, r.json()["run_id"], who)
        assert system_fills() == 3  # one public prefix, shared by both tenants
