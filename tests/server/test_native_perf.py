"""`GET /v1/runs/{id}/variables/{name}`: `perf` re-deduces a run's objectives only when
given; omitted, the objectives the client stated stand (a run with none waits with latency).

Call `a` (x -> y) is held running by the engine's gate while the client polls `z`; call
`b` (y -> z) becomes ready after that, so its engine priority (0: latency, 1: throughput)
shows the objectives as the poll left them.
"""

from __future__ import annotations

import asyncio

import pytest

from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import echo, native_app, run_body, sse_events
from .test_native_api import CHAIN


async def _poll_while_a_runs(
    tmp_path, outputs: dict, params: dict, added: dict | None = None
) -> tuple[list, list, list]:
    """The engine priorities of `a` and `b`, the objectives events, and the calls'
    objectives in the run's detail, after polling `z` with `params` while `a` runs.
    `added`: the run is open with `a` only, and `b` is added (with these outputs) while
    `a` runs."""
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine) as (c, _):
        calls = CHAIN if added is None else CHAIN[:1]
        body = run_body(*calls, inputs={"x": "go"}, outputs=outputs, open=added is not None)
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        while not engine.generations:  # `a` started; the gate holds it
            await asyncio.sleep(0.01)
        if added is not None:
            more = {"calls": [CHAIN[1]], "outputs": added}
            assert (await c.post(f"/v1/runs/{rid}/calls", json=more)).status_code == 200
            assert (await c.post(f"/v1/runs/{rid}/close")).status_code == 200
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={**params, "timeout": 0.1})
        assert r.status_code == 408, r.text
        gate.set()
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={**params, "timeout": 10})
        assert r.status_code == 200 and r.json()["value"] == "<<go>>", r.text
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
    objectives = [e["data"]["calls"] for e in events if e["event"] == "objectives"]
    return (
        [g.priority for g in engine.generations],
        objectives,
        [k["objective"] for k in detail["calls"]],
    )


async def test_a_poll_without_perf_keeps_a_throughput_run_at_throughput(tmp_path) -> None:
    priorities, objectives, detail = await _poll_while_a_runs(tmp_path, {"z": "throughput"}, {})
    assert priorities == [1, 1]
    assert len(objectives) == 1  # deduced once, at submission
    assert detail == ["throughput", "throughput"]


async def test_a_poll_with_perf_latency_makes_the_rest_of_the_run_latency(tmp_path) -> None:
    priorities, objectives, detail = await _poll_while_a_runs(
        tmp_path, {"z": "throughput"}, {"perf": "latency"}
    )
    assert priorities == [1, 0]  # `a` was running already; `b` starts as a latency call
    assert [o["b"]["objective"] for o in objectives] == ["throughput", "latency"]
    assert detail == ["latency", "latency"]


async def test_a_poll_without_perf_on_a_run_that_stated_nothing_waits_with_latency(
    tmp_path,
) -> None:
    priorities, objectives, _ = await _poll_while_a_runs(tmp_path, {}, {})
    assert priorities == [1, 0]
    assert [o["b"]["objective"] for o in objectives] == ["throughput", "latency"]


async def test_outputs_stated_with_added_calls_stand_too(tmp_path) -> None:
    priorities, _, detail = await _poll_while_a_runs(tmp_path, {}, {}, {"z": "throughput"})
    assert priorities == [1, 1]
    assert detail == ["throughput", "throughput"]


async def test_a_poll_with_perf_gets_a_value_set_while_its_deduction_waits(tmp_path) -> None:
    """`z`'s value is being recorded (a slow listener holds the run's event lock) when a
    poll with `perf` changes the objectives: the poll's deduction waits for that lock, and
    the value, set meanwhile, still answers the poll (one `Manager.get` does it)."""
    recording = asyncio.Event()

    class SlowToRecordZ:
        async def on_event(self, run_id: str, type: str, payload: dict) -> None:
            if type == "variable_ready" and payload["name"] == "z":
                recording.set()
                await asyncio.sleep(0.3)

    async with native_app(tmp_path) as (c, rt):
        rt.manager.listeners.append(SlowToRecordZ())
        body = run_body(*CHAIN, inputs={"x": "go"}, outputs={"z": "throughput"})
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        await asyncio.wait_for(recording.wait(), 10)
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={"perf": "latency", "timeout": 3})
    assert r.status_code == 200 and r.json()["value"] == "<<go>>", r.text


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database(request, tmp_path) -> str:
    """One database file (SQLite) or a fresh PostgreSQL database, for two servers."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'parrot.db'}"
    return request.getfixturevalue("pg_database")


async def _priorities_after_a_restart(
    tmp_path, url: str, outputs: dict, added: dict | None, params: dict | None = None
) -> list[int]:
    """The engine priorities of `a` and `b` on a second server on the same database. The
    first stops while `a` runs, after `b` was added with outputs `added` (the run open
    until then) or `z` was polled with `params`. The second server polls `z` without
    perf while `a` runs again (as a client's next poll), then reads the run's end from
    its events (no more polls)."""
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine, url=url) as (c, _):
        calls = CHAIN if added is None else CHAIN[:1]
        body = run_body(*calls, inputs={"x": "go"}, outputs=outputs, open=added is not None)
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        while not engine.generations:  # `a` started; the gate holds it
            await asyncio.sleep(0.01)
        if added is not None:
            more = {"calls": [CHAIN[1]], "outputs": added, "close": True}
            assert (await c.post(f"/v1/runs/{rid}/calls", json=more)).status_code == 200
        if params is not None:
            r = await c.get(f"/v1/runs/{rid}/variables/z", params={**params, "timeout": 0.1})
            assert r.status_code == 408, r.text
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine, url=url) as (c, rt):
        assert rt.recovered == [rid]
        while not engine.generations:  # `a` runs again
            await asyncio.sleep(0.01)
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 0.1})
        assert r.status_code == 408, r.text
        gate.set()
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        assert events[-1]["data"]["status"] == "finished", events[-3:]
    return [g.priority for g in engine.generations]


async def test_outputs_stated_with_added_calls_survive_a_restart(tmp_path, database) -> None:
    priorities = await _priorities_after_a_restart(tmp_path, database, {}, {"z": "latency"})
    assert priorities == [0, 0]


async def test_the_perf_of_a_poll_survives_a_restart(tmp_path, database) -> None:
    priorities = await _priorities_after_a_restart(
        tmp_path, database, {"z": "throughput"}, None, {"perf": "latency"}
    )
    assert priorities == [0, 0]


async def test_a_criterion_stated_with_added_calls_still_stands_after_a_restart(
    tmp_path, database
) -> None:
    """Stated with the added calls, `throughput` stands after the restart too: the poll
    without perf there does not make the run wait with latency."""
    priorities = await _priorities_after_a_restart(tmp_path, database, {}, {"z": "throughput"})
    assert priorities == [1, 1]
