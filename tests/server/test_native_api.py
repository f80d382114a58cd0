"""Native API in-process (scripted engine, SQLite): runs, variables, events, workflows."""

from __future__ import annotations

import asyncio

import httpx

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store
from parrot_backend.testing.fake_engine import ScriptedEngine

from .conftest import LiveServer, wait_until
from .native_support import ALICE, KEYS, echo, native_app, run_body, sse_events

CHAIN = (
    {"name": "a", "template": "Start {{input:x}} {{output:y}}"},
    {"name": "b", "template": "Then {{input:y}} {{output:z}}"},
)


async def finished(c: httpx.AsyncClient, rid: str) -> list[dict]:
    """The run's whole event log (the stream ends at run_finished)."""
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["event"] == "run_finished"
    return events


async def test_run_chain_values_and_detail(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        r = await c.post(
            "/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}, outputs={"z": "latency"})
        )
        assert r.status_code == 201, r.text
        rid = r.json()["run_id"]
        z = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})
        assert z.status_code == 200, z.text
        assert (z.json()["status"], z.json()["value"]) == ("ready", "<<go>>")
        assert z.json()["producer_call"] == 1 and z.json()["set_at"] is not None
        await finished(c, rid)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["y"]["value"] == "<go>"
        assert [(k["name"], k["status"]) for k in detail["calls"]] == [("a", "done"), ("b", "done")]
        assert [k["objective"] for k in detail["calls"]] == ["latency", "latency"]
        assert detail["calls"][0]["completion_tokens"] == len("<go>") + 1  # and the EOS
        assert detail["calls"][0]["first_token_at"] is not None
        assert detail["calls"][0]["finished_at"] is not None
        assert detail["run"]["status"] == "done"
        assert detail["run"]["outputs"] == {"z": "latency"}
        runs = (await c.get("/v1/runs")).json()["runs"]
        assert [x["run_id"] for x in runs] == [rid]
        assert (await c.get("/v1/runs", params={"status": "failed"})).json()["runs"] == []


async def test_events_carry_tokens_and_resume_after_last_event_id(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()["run_id"]
        events = await finished(c, rid)
        assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
        types = [e["event"] for e in events]
        assert types[0] == "run_created" and "objectives" in types
        tokens = "".join(
            e["data"]["text"]
            for e in events
            if e["event"] == "token" and e["data"]["variable"] == "y"
        )
        assert tokens == "<go>"
        # tokens of y all come before y's value and before call a finishes
        ready_y = next(
            i
            for i, e in enumerate(events)
            if e["event"] == "variable_ready" and e["data"]["name"] == "y"
        )
        last_tok = max(
            i
            for i, e in enumerate(events)
            if e["event"] == "token" and e["data"]["variable"] == "y"
        )
        assert last_tok < ready_y
        # the log keeps the manager's order, call ends (written with the run's next
        # write) included
        steps = [
            (e["event"], e["data"].get("name") or e["data"].get("call"))
            for e in events
            if e["event"] != "token"
        ]
        assert steps[2:] == [
            ("call_started", "a"),
            ("variable_ready", "y"),
            ("call_finished", "a"),
            ("call_started", "b"),
            ("variable_ready", "z"),
            ("call_finished", "b"),
            ("run_finished", None),
        ]
        for cut in (1, 5, len(events) - 1):
            tail = sse_events(
                (await c.get(f"/v1/runs/{rid}/events", headers={"Last-Event-ID": str(cut)})).text
            )
            assert tail == events[cut:]
        # a browser reconnecting resends the URL's `after` and a newer Last-Event-ID: the
        # larger one wins (no duplicates)
        later = sse_events(
            (
                await c.get(
                    f"/v1/runs/{rid}/events", params={"after": 1}, headers={"Last-Event-ID": "3"}
                )
            ).text
        )
        assert [e["id"] for e in later] == [e["id"] for e in events if int(e["id"]) > 3]
        same = sse_events((await c.get(f"/v1/runs/{rid}/events", params={"after": 3})).text)
        assert same == events[3:]
        bad = await c.get(f"/v1/runs/{rid}/events", headers={"Last-Event-ID": "x:1"})
        assert bad.status_code == 400


async def test_open_run_takes_calls_and_inputs_then_closes(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(CHAIN[0], open=True))).json()["run_id"]
        added = await c.post(
            f"/v1/runs/{rid}/calls", json={"calls": [{"template": "More {{input:y}} {{output:w}}"}]}
        )
        assert added.status_code == 200, added.text
        assert added.json()["names"] == ["#1"]
        put = await c.put(f"/v1/runs/{rid}/variables/x", json={"value": "hey"})
        assert put.status_code == 200, put.text
        again = await c.put(f"/v1/runs/{rid}/variables/x", json={"value": "other"})
        assert again.status_code == 409
        gen = await c.put(f"/v1/runs/{rid}/variables/y", json={"value": "forged"})
        assert gen.status_code == 400
        w = await c.get(f"/v1/runs/{rid}/variables/w", params={"timeout": 10})
        assert w.json()["value"] == "<<hey>>"
        closed = await c.post(f"/v1/runs/{rid}/close")
        assert closed.status_code == 200, closed.text
        await finished(c, rid)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert [k["name"] for k in detail["calls"]] == ["a", "#1"]
        assert len(detail["program"]["calls"]) == 2  # the merged program is stored
        late = await c.post(
            f"/v1/runs/{rid}/calls", json={"calls": [{"template": "x {{output:q}}"}]}
        )
        assert late.status_code == 409


async def test_long_poll_times_out_clearly_and_cancel_stops_the_run(tmp_path) -> None:
    gate = asyncio.Event()
    async with native_app(tmp_path, engine=ScriptedEngine(reply=echo, gate=gate)) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()["run_id"]
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 0.05})
        assert r.status_code == 408
        assert "not ready" in r.json()["error"]["message"]
        cancelled = await c.post(f"/v1/runs/{rid}/cancel")
        assert cancelled.json()["status"] == "cancelled"
        r = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 1})
        assert r.status_code == 409
        events = await finished(c, rid)
        assert events[-1]["data"] == {"status": "cancelled"}
        gate.set()


async def test_failed_call_fails_its_variable(tmp_path) -> None:
    engine = ScriptedEngine(reply=echo, fail_if=lambda p: "Then" in p)
    async with native_app(tmp_path, engine=engine) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()["run_id"]
        z = (await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})).json()
        assert z["status"] == "failed" and "EngineError" in z["error"]
        await finished(c, rid)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["run"]["status"] == "failed"
        assert detail["variables"]["z"]["status"] == "failed"
        assert [k["status"] for k in detail["calls"]] == ["done", "failed"]
        # the stored log has the variable's failure once, after its call's (it was dropped:
        # the call's failure had already marked the variable failed)
        tenant = await rt.tenant_id("alice")
        stored = [(e.type, e.payload) for e in rt.store.read_events(tenant, rid)]
        kinds = [t for t, _ in stored]
        assert kinds.count("variable_failed") == 1
        order = [kinds.index(k) for k in ("call_failed", "variable_failed", "run_finished")]
        assert order == sorted(order)
        [failed] = [q for t, q in stored if t == "variable_failed"]
        assert failed["name"] == "z" and failed["error"].startswith("call 'b' failed: ")
        assert detail["variables"]["z"]["error"] == failed["error"]


async def test_workflows_are_versioned_and_run(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        program = {"calls": list(CHAIN)}
        v1 = await c.post("/v1/workflows", json={"name": "story", "program": program})
        assert v1.status_code == 201, v1.text
        v2 = await c.post(
            "/v1/workflows", json={"name": "story", "program": program, "public": True}
        )
        assert (v1.json()["version"], v2.json()["version"]) == (1, 2)
        assert v2.json()["program"]["public"] is True
        listed = (await c.get("/v1/workflows")).json()["workflows"]
        assert [(w["name"], w["version"]) for w in listed] == [("story", 1), ("story", 2)]
        r = await c.post("/v1/workflows/story/runs", json={"inputs": {"x": "a"}, "version": 1})
        assert r.status_code == 201, r.text
        assert (r.json()["workflow"], r.json()["version"]) == ("story", 1)
        rid = r.json()["run_id"]
        z = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})
        assert z.json()["value"] == "<<a>>"
        # a replay of a workflow's run is a run of that workflow version; no body needed
        again = await c.post(f"/v1/runs/{rid}/replay")
        assert again.status_code == 201, again.text
        assert again.json()["replay_of"] == rid
        assert (again.json()["workflow"], again.json()["version"]) == ("story", 1)
        z = await c.get(f"/v1/runs/{again.json()['run_id']}/variables/z", params={"timeout": 10})
        assert z.json()["value"] == "<<a>>"
        missing = await c.post("/v1/workflows/nope/runs", json={"inputs": {}})
        assert missing.status_code == 404


async def test_replay_gives_the_same_outputs_or_new_ones_for_new_inputs(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        rid = (
            await c.post(
                "/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}, outputs={"z": "latency"})
            )
        ).json()["run_id"]
        await finished(c, rid)
        same = (await c.post(f"/v1/runs/{rid}/replay", json={})).json()
        assert same["replay_of"] == rid
        new = (await c.post(f"/v1/runs/{rid}/replay", json={"inputs": {"x": "stop"}})).json()
        values = {}
        for run in (rid, same["run_id"], new["run_id"]):
            await finished(c, run)
            detail = (await c.get(f"/v1/runs/{run}")).json()
            values[run] = {n: v["value"] for n, v in detail["variables"].items()}
        assert values[same["run_id"]] == values[rid]
        assert values[new["run_id"]] == {"x": "stop", "y": "<stop>", "z": "<<stop>>"}
        detail = (await c.get(f"/v1/runs/{same['run_id']}")).json()
        assert detail["run"]["replay_of"] == rid


async def test_replay_states_the_objectives_the_original_ended_with(tmp_path) -> None:
    """A poll's `perf` stated after creation (a wait, persisted) is an output of the
    replay too, so the replay deduces the same objectives as the original ended with."""
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    async with native_app(tmp_path, engine=engine) as (c, rt):
        body = run_body(*CHAIN, inputs={"x": "go"}, outputs={"y": "throughput"})
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        poll = asyncio.create_task(
            c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10, "perf": "throughput"})
        )
        for _ in range(500):  # the poll registers its wait (the run is held at the gate)
            if rt.manager.runs[rid].waits.get("z") == "throughput":
                break
            await asyncio.sleep(0.01)
        assert rt.manager.runs[rid].waits == {"z": "throughput"}
        gate.set()
        assert (await poll).json()["value"] == "<<go>>"
        await finished(c, rid)
        original = (await c.get(f"/v1/runs/{rid}")).json()
        assert original["run"]["outputs"] == {"y": "throughput"}  # as created
        replay = (await c.post(f"/v1/runs/{rid}/replay", json={})).json()["run_id"]
        await finished(c, replay)
        detail = (await c.get(f"/v1/runs/{replay}")).json()
        assert detail["run"]["outputs"] == {"y": "throughput", "z": "throughput"}
        assert [k["objective"] for k in detail["calls"]] == [
            k["objective"] for k in original["calls"]
        ]
        assert {n: v["value"] for n, v in detail["variables"].items()} == {
            n: v["value"] for n, v in original["variables"].items()
        }


async def test_runs_resume_after_a_restart_without_recomputing(tmp_path) -> None:
    """In-process restart: a runtime stopped mid-run leaves it unfinished in the store; a
    new one on the same database resumes it, keeping the values already there."""
    url = f"sqlite:///{tmp_path / 'parrot.db'}"
    gate = asyncio.Event()
    gate.set()
    engine = ScriptedEngine(reply=echo, gate=gate)
    later = [CHAIN[1], {"name": "c", "template": "Last {{input:z}} {{output:w}}"}]
    async with native_app(tmp_path, engine=engine, url=url) as (c, rt):
        rid = (
            await c.post("/v1/runs", json=run_body(CHAIN[0], inputs={"x": "go"}, open=True))
        ).json()["run_id"]
        await c.get(f"/v1/runs/{rid}/variables/y", params={"timeout": 10})
        gate.clear()  # b will wait: stop the server with the run unfinished
        assert (await c.post(f"/v1/runs/{rid}/calls", json={"calls": later})).status_code == 200
        assert (await c.post(f"/v1/runs/{rid}/close")).status_code == 200
        await asyncio.sleep(0.05)
        y_before = (await c.get(f"/v1/runs/{rid}")).json()["variables"]["y"]
    engine2 = ScriptedEngine(reply=echo)
    async with native_app(tmp_path, engine=engine2, url=url) as (c, rt):
        assert rt.recovered == [rid]
        w = await c.get(f"/v1/runs/{rid}/variables/w", params={"timeout": 10})
        assert w.json()["value"] == "<<<go>>>"
        events = await finished(c, rid)
        assert "run_resumed" in [e["event"] for e in events]
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["y"] == y_before  # same value, same set_at
        assert not any("Start" in g.prompt for g in engine2.generations)  # a not rerun


async def test_a_call_end_lost_in_a_crash_is_recorded_at_recovery(tmp_path) -> None:
    """A call's end is buffered (nothing waits on it). Lost in a crash, recovery records
    it (the call's outputs are all set): nothing is generated again, the value stays."""
    url = f"sqlite:///{tmp_path / 'parrot.db'}"
    async with native_app(tmp_path, url=url, flush_interval_s=3600) as (c, rt):
        rid = (
            await c.post("/v1/runs", json=run_body(CHAIN[0], inputs={"x": "go"}, open=True))
        ).json()["run_id"]
        await c.get(f"/v1/runs/{rid}/variables/y", params={"timeout": 10})
        for _ in range(500):  # the manager finishes call a right after y
            if rt.persister.runs[rid].finishes:
                break
            await asyncio.sleep(0.01)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["calls"][0]["status"] == "running"  # its end is not written yet
        y_before = detail["variables"]["y"]
        meta = rt.persister.runs[rid]  # "crash": what is buffered is lost
        meta.buffered.clear()
        meta.finishes.clear()
        rt.persister.frozen = True
    engine2 = ScriptedEngine(reply=echo)
    async with native_app(tmp_path, engine=engine2, url=url) as (c, rt):
        assert rt.recovered == [rid]
        added = await c.post(f"/v1/runs/{rid}/calls", json={"calls": [CHAIN[1]]})
        assert added.status_code == 200, added.text
        assert (await c.post(f"/v1/runs/{rid}/close")).status_code == 200
        events = await finished(c, rid)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["y"] == y_before
        assert detail["variables"]["z"]["value"] == "<<go>>"
        assert [(k["name"], k["status"], k["attempts"]) for k in detail["calls"]] == [
            ("a", "done", 1),
            ("b", "done", 1),
        ]
        assert not any("Start" in g.prompt for g in engine2.generations)  # a generated nothing
        ready = [e["data"]["name"] for e in events if e["event"] == "variable_ready"]
        assert ready.count("y") == 1
        ends = [e["data"] for e in events if e["event"] == "call_finished"]
        assert ends[0] == {"call": "a", "recovered": True}  # the end, recorded
        assert ends[1]["call"] == "b" and ends[1]["completion_tokens"] > 0


def test_sse_stream_disconnect_releases_the_run(tmp_path) -> None:
    """A client leaving a live SSE stream (real sockets) leaves nothing behind."""
    gate = asyncio.Event()
    engine = ScriptedEngine(reply=echo, gate=gate)
    store = Store(f"sqlite:///{tmp_path / 'parrot.db'}")
    rt = NativeRuntime(store, {"e0": engine}, worker="w")
    app = create_app(engine, settings=ServerSettings(api_keys=dict(KEYS), sse_ping_s=1), native=rt)
    with LiveServer(app) as live:
        rid = httpx.post(
            f"{live.url}/v1/runs", headers=ALICE, json=run_body(*CHAIN, inputs={"x": "go"})
        ).json()["run_id"]
        for _ in range(3):
            with httpx.stream(
                "GET", f"{live.url}/v1/runs/{rid}/events", headers=ALICE, timeout=10
            ) as r:
                first = next(r.iter_lines())
                assert first.startswith("id: 1") or first.startswith("event:")
            # the client left mid-run: the stream's generator cleaned up
            assert wait_until(lambda: rt.notifier.watched == 0)
        assert rt.manager.runs[rid].state == "running"  # left running: shutdown stops it
    store.close()


async def test_finished_runs_leave_memory_and_answer_from_the_store(tmp_path) -> None:
    async with native_app(tmp_path, keep_finished_s=0) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"}))).json()["run_id"]
        await finished(c, rid)
        for _ in range(100):  # the forget is scheduled right after the run's end
            if rid not in rt.manager.runs:
                break
            await asyncio.sleep(0.01)
        assert rid not in rt.manager.runs and rid not in rt.persister.runs
        z = await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 1})
        assert (z.status_code, z.json()["value"]) == (200, "<<go>>")
        assert (await c.get(f"/v1/runs/{rid}/variables/nope")).status_code == 404
        assert (
            await c.post(f"/v1/runs/{rid}/calls", json={"calls": [{"template": "x {{output:q}}"}]})
        ).status_code == 409
        assert (await c.post(f"/v1/runs/{rid}/cancel")).json()["status"] == "done"
        assert len(sse_events((await c.get(f"/v1/runs/{rid}/events")).text)) > 5


async def test_inputs_set_later_are_in_the_detail_and_a_cancelled_run_is_not_open(
    tmp_path,
) -> None:
    gate = asyncio.Event()
    async with native_app(tmp_path, engine=ScriptedEngine(reply=echo, gate=gate)) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, open=True))).json()["run_id"]
        put = await c.put(f"/v1/runs/{rid}/variables/x", json={"value": "hey"})
        assert put.status_code == 200
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["inputs"] == {"x": "hey"}  # given after the run was created
        assert detail["run"]["open"] is True
        cancelled = await c.post(f"/v1/runs/{rid}/cancel")
        assert cancelled.json()["status"] == "cancelled"
        assert cancelled.json()["open"] is False  # over: it takes no calls or inputs
        assert (await c.get(f"/v1/runs/{rid}")).json()["run"]["open"] is False
        gate.set()
