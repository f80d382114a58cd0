"""One request per step of a client that runs code between server-side steps: a run
created with `?stream=true` answers with its own event stream, and `POST .../calls`
adds calls, sets inputs and closes the run in one request."""

from __future__ import annotations

from .native_support import native_app, run_body, sse_events

A = {"name": "a", "template": "Start {{input:x}} {{output:y}}"}


async def test_create_and_stream_in_one_request(tmp_path):
    async with native_app(tmp_path) as (c, _):
        r = await c.post("/v1/runs?stream=true", json=run_body(A, inputs={"x": "go"}))
        assert r.status_code == 201 and r.headers["content-type"].startswith("text/event-stream")
        rid = r.headers["X-Parrot-Run-Id"]
        events = sse_events(r.text)
        assert events[0]["event"] == "run_created" and events[-1]["event"] == "run_finished"
        ready = [e["data"] for e in events if e["event"] == "variable_ready"]
        assert {v["name"]: v["value"] for v in ready}["y"] == "<go>"
        again = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        assert again == events  # the same committed log


async def test_add_calls_set_inputs_and_close_in_one_request(tmp_path):
    async with native_app(tmp_path) as (c, _):
        rid = (await c.post("/v1/runs", json=run_body(A, inputs={"x": "go"}, open=True))).json()[
            "run_id"
        ]
        body = {
            "calls": [{"name": "b", "template": "{{input:y}} and {{input:z}} {{output:w}}"}],
            "inputs": {"z": "zed"},
            "close": True,
        }
        r = await c.post(f"/v1/runs/{rid}/calls", json=body)
        assert r.status_code == 200 and r.json()["names"] == ["b"], r.text
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        assert events[-1]["data"]["status"] == "finished"
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["w"]["value"] == "<zed>" and not detail["run"]["open"]


async def test_add_calls_refuses_bad_inputs_before_changing_anything(tmp_path):
    async with native_app(tmp_path) as (c, _):
        rid = (await c.post("/v1/runs", json=run_body(A, inputs={"x": "go"}, open=True))).json()[
            "run_id"
        ]
        cases = [
            ({"inputs": {"x": "again"}}, 409, "already"),
            ({"inputs": {"y": "v"}}, 400, "generated"),
            ({"calls": [{"template": "{{output:q}}"}], "inputs": {"q": "v"}}, 400, "q"),
            ({}, 400, "calls"),
            ({"inputs": {"a b": "v"}}, 400, "invalid variable name"),
        ]
        for body, status, says in cases:
            r = await c.post(f"/v1/runs/{rid}/calls", json=body)
            assert r.status_code == status, (body, r.text)
            assert says in r.json()["error"]["message"], (body, r.text)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert [x["name"] for x in detail["calls"]] == ["a"]  # nothing was added
        assert (await c.post(f"/v1/runs/{rid}/calls", json={"close": True})).status_code == 200
        r = await c.post(f"/v1/runs/{rid}/calls", json={"inputs": {"z": "v"}})
        assert r.status_code == 409


def test_frames_send_a_read_as_one_chunk_and_stop_at_the_run_end():
    from datetime import UTC, datetime

    from parrot_backend.server.event_stream import frame, frames
    from parrot_backend.store import EventRecord

    def ev(seq, type, payload):
        return EventRecord("r1", seq, type, payload, datetime.now(UTC))

    events = [
        ev(3, "token", {"call": "a", "text": "hé\n"}),
        ev(4, "variable_ready", {"name": "y", "value": "v"}),
        ev(5, "run_finished", {"status": "finished"}),
        ev(6, "token", {"call": "late"}),  # never after the run's end
    ]
    chunk, finished = frames(events)
    assert finished
    assert chunk == b"".join(frame(e).encode() for e in events[:3])
    parsed = sse_events(chunk.decode())
    assert [(e["event"], e["id"]) for e in parsed] == [
        ("token", "3"),
        ("variable_ready", "4"),
        ("run_finished", "5"),
    ]
    assert parsed[0]["data"] == {"call": "a", "text": "hé\n"}
    chunk, finished = frames(events[:2])
    assert not finished and len(sse_events(chunk.decode())) == 2
