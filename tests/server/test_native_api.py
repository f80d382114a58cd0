"""Native API in-process (scripted engine, SQLite): runs, variables, events, workflows."""

from __future__ import annotations

import asyncio

from native_support import BOB, echo, native_app, run_body, sse_events

from parrot_backend.manager.scripted import ScriptedEngine

CHAIN = (
    {"name": "a", "template": "Start {{input:x}} {{output:y}}"},
    {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
)


async def test_run_chain_values_and_detail(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        r = await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"},
                                                   outputs={"z": "latency"}))
        assert r.status_code == 201, r.text
        rid = r.json()["run_id"]
        z = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})
        assert z.status_code == 200, z.text
        assert z.json() == {"name": "z", "status": "ready", "value": "<<go>>", "error": None,
                            "producer_call": None, "set_at": None}
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)  # ends when done
        assert events[-1]["event"] == "run_finished"
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["y"]["value"] == "<go>"
        assert [(k["name"], k["status"]) for k in detail["calls"]] == [("a", "done"),
                                                                       ("b", "done")]
        assert detail["calls"][1]["objective"] == "latency"
        assert detail["calls"][0]["completion_tokens"] == len("<go>")
        assert detail["calls"][0]["first_token_at"] is not None
        assert detail["run"]["status"] == "done"
        runs = (await c.get("/v1/runs")).json()["runs"]
        assert [x["run_id"] for x in runs] == [rid]
