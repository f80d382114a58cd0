"""Replay of runs that did not simply finish: failed, cancelled, still running, still open;
and the 4xx answers of a replay that cannot be (scripted engine, SQLite, in process)."""

from __future__ import annotations

import asyncio

import httpx

from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import echo, native_app, run_body, sse_events

CHAIN = (
    {"name": "a", "template": "Start {{input:x}} {{output:y}}"},
    {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
)


async def _end(c: httpx.AsyncClient, rid: str) -> dict:
    """Wait for the run's end (its stream ends at run_finished); returns its detail."""
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["event"] == "run_finished"
    return (await c.get(f"/v1/runs/{rid}")).json()


def _values(detail: dict) -> dict:
    return {n: (v["status"], v["value"]) for n, v in detail["variables"].items()}


async def _replay(c: httpx.AsyncClient, rid: str, body: dict | None = None) -> str:
    r = await c.post(f"/v1/runs/{rid}/replay", json=body if body is not None else {})
    assert r.status_code == 201, r.text
    assert r.json()["replay_of"] == rid
    return r.json()["run_id"]


async def test_replay_of_a_failed_run_fails_alike_and_runs_with_new_inputs(tmp_path) -> None:
    engine = ScriptedEngine(reply=echo, fail_if=lambda prompt: "bad" in prompt)
    async with native_app(tmp_path, engine=engine) as (c, _rt):
        body = run_body(*CHAIN, inputs={"x": "bad"}, outputs={"z": "latency"})
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        original = await _end(c, rid)
        assert original["run"]["status"] == "failed"
        again = await _end(c, await _replay(c, rid))
        assert again["run"]["status"] == "failed"
        assert [k["status"] for k in again["calls"]] == ["failed", "failed"]
        fixed = await _end(c, await _replay(c, rid, {"inputs": {"x": "good"}}))
        assert fixed["run"]["status"] == "done"
        assert _values(fixed) == {
            "x": ("ready", "good"),
            "y": ("ready", "<good>"),
            "z": ("ready", "<<good>>"),
        }
        assert fixed["run"]["outputs"] == {"z": "latency"}


async def test_replay_of_a_cancelled_or_running_run_runs_it_whole(tmp_path) -> None:
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine) as (c, _rt):
        running = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()
        running = running["run_id"]
        cancelled = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()
        cancelled = cancelled["run_id"]
        assert (await c.post(f"/v1/runs/{cancelled}/cancel")).status_code == 200
        assert (await _end(c, cancelled))["run"]["status"] == "cancelled"
        # the original still runs (held at the gate): its replay is a run of its own
        of_running = await _replay(c, running)
        of_cancelled = await _replay(c, cancelled)
        gate.set()
        done = [await _end(c, r) for r in (running, of_running, of_cancelled)]
        assert [d["run"]["status"] for d in done] == ["done"] * 3
        assert _values(done[1]) == _values(done[2]) == _values(done[0])
        assert _values(done[0])["z"] == ("ready", "<<go>>")


async def test_replay_of_an_open_run_needs_its_missing_inputs(tmp_path) -> None:
    async with native_app(tmp_path) as (c, _rt):
        body = run_body(*CHAIN, open=True)
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        r = await c.post(f"/v1/runs/{rid}/replay", json={})
        assert r.status_code == 400 and "'x'" in r.json()["error"]["message"], r.text
        replay = await _end(c, await _replay(c, rid, {"inputs": {"x": "late"}}))
        assert _values(replay)["z"] == ("ready", "<<late>>")
        assert (await c.post(f"/v1/runs/{rid}/cancel")).status_code == 200


async def test_a_replay_that_cannot_be_is_a_clear_4xx(tmp_path) -> None:
    async with native_app(tmp_path) as (c, _rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()
        rid = rid["run_id"]
        await _end(c, rid)
        cases = [
            (rid, {"inputs": {"nope": "1"}}, 400, "no input(s) ['nope']"),
            (rid, {"inputs": {"y": "forced"}}, 400, "'y' is produced by call 'a'"),
            (rid, {"inputs": {"x": 5}}, 400, "inputs.x"),
            (rid, {"inputs": "x"}, 400, "inputs"),
            (rid, {"extra": 1}, 400, "extra"),
            ("0" * 32, {}, 404, "no run"),
            ("not-a-run", {}, 404, "no run"),
        ]
        for run, body, status, says in cases:
            r = await c.post(f"/v1/runs/{run}/replay", json=body)
            assert r.status_code == status, (body, r.text)
            assert says in r.json()["error"]["message"], (body, r.text)
        # none of them created a run
        assert len((await c.get("/v1/runs")).json()["runs"]) == 1
