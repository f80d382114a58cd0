"""Changes to an open run that race each other take effect one after the other, as if
sent in turn (`Run.mutex`): an input set by several requests at once is taken once (the
others are 409s, and one value is stored and used); a close racing a value or a call is
either before it (the other is a 409) or after it; and a request of calls, inputs and a
close that could not close changes nothing. Found by fuzzing a live server: 2-12 of 12
concurrent PUTs of one input were each answered 200 and stored as events."""

from __future__ import annotations

import asyncio

import pytest

from .native_support import native_app, run_body, sse_events

READS_Q = {"name": "a", "template": "Q {{input:q}} {{output:a}}"}


async def _log(c, rid: str) -> list[dict]:
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["event"] == "run_finished"
    return events


async def test_one_input_put_many_times_at_once_is_taken_once(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        for trial in range(4):
            rid = (await c.post("/v1/runs", json=run_body(READS_Q, open=True))).json()["run_id"]
            values = [f"v{trial}_{i}" for i in range(10)]
            answers = await asyncio.gather(
                *(c.put(f"/v1/runs/{rid}/variables/q", json={"value": v}) for v in values)
            )
            codes = sorted(r.status_code for r in answers)
            assert codes == [200] + [409] * 9, [r.text for r in answers]
            (won,) = [r.json()["value"] for r in answers if r.status_code == 200]
            for r in answers:
                if r.status_code == 409:
                    assert r.json()["error"]["code"] == "already_set"
            assert (await c.post(f"/v1/runs/{rid}/close")).status_code == 200
            events = await _log(c, rid)
            ready = [e["data"] for e in events if e["event"] == "variable_ready"]
            assert [d["value"] for d in ready if d["name"] == "q"] == [won]
            detail = (await c.get(f"/v1/runs/{rid}")).json()
            assert detail["variables"]["q"]["value"] == won
            assert detail["variables"]["a"]["value"] == f"<{won}>"  # the call read it


async def test_a_close_racing_an_input_no_call_reads_is_before_or_after_it(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        seen = set()
        for _ in range(6):
            rid = (
                await c.post("/v1/runs", json=run_body(READS_Q, inputs={"q": "1"}, open=True))
            ).json()["run_id"]
            put, close = await asyncio.gather(
                c.put(f"/v1/runs/{rid}/variables/stray", json={"value": "s"}),
                c.post(f"/v1/runs/{rid}/close"),
            )
            pair = (put.status_code, close.status_code)
            # in turn: the value first (then the close names it: 400), or the close first
            # (then the run takes no value: 409); never both accepted
            assert pair in {(200, 400), (409, 200)}, (put.text, close.text)
            if close.status_code == 400:
                assert "stray" in close.json()["error"]["message"]
            else:
                assert put.json()["error"]["code"] == "run_closed"
            seen.add(pair)
            if close.status_code != 200:
                await c.post(f"/v1/runs/{rid}/cancel")
        assert seen


async def test_calls_racing_a_close_are_added_before_it_or_refused_as_closed(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        for _ in range(6):
            rid = (
                await c.post("/v1/runs", json=run_body(READS_Q, inputs={"q": "1"}, open=True))
            ).json()["run_id"]
            added, close = await asyncio.gather(
                c.post(
                    f"/v1/runs/{rid}/calls",
                    json={"calls": [{"name": "b", "template": "B {{input:a}} {{output:b}}"}]},
                ),
                c.post(f"/v1/runs/{rid}/close"),
            )
            assert close.status_code == 200, close.text
            assert added.status_code in (200, 409), added.text
            events = await _log(c, rid)
            kinds = [e["event"] for e in events]
            if added.status_code == 409:
                assert added.json()["error"]["code"] == "run_closed"
                assert "calls_added" not in kinds
            else:
                assert kinds.index("calls_added") < kinds.index("run_closed")
                detail = (await c.get(f"/v1/runs/{rid}")).json()
                assert detail["variables"]["b"]["value"] == "<<1>>"


@pytest.mark.parametrize(
    "body,complete",
    [
        # a new call reads an input nobody gives (nor the run's own input)
        (
            {"calls": [{"name": "g", "template": "A {{input:need}} {{output:g}}"}], "close": True},
            {"q": "1", "need": "n"},
        ),
        # an input given with the calls, but the run's own input is still missing
        (
            {
                "calls": [{"name": "g", "template": "A {{input:r}} {{output:g}}"}],
                "inputs": {"r": "x"},
                "close": True,
            },
            {"q": "1", "r": "x"},
        ),
    ],
)
async def test_calls_inputs_and_a_close_that_cannot_close_change_nothing(
    tmp_path, body, complete
) -> None:
    async with native_app(tmp_path) as (c, rt):
        rid = (await c.post("/v1/runs", json=run_body(READS_Q, open=True))).json()["run_id"]
        before = (await c.get(f"/v1/runs/{rid}")).json()
        r = await c.post(f"/v1/runs/{rid}/calls", json=body)
        assert r.status_code == 400, r.text
        assert "never provided" in r.json()["error"]["message"]
        after = (await c.get(f"/v1/runs/{rid}")).json()
        assert [k["name"] for k in after["calls"]] == [k["name"] for k in before["calls"]]
        assert after["program"] == before["program"]
        assert after["variables"] == before["variables"]
        assert "g" not in rt.manager.runs[rid].program.calls
        assert rt.manager.runs[rid].open and "r" not in rt.manager.runs[rid].values
        # the same request, completed, goes through whole
        ok = await c.post(f"/v1/runs/{rid}/calls", json={**body, "inputs": complete})
        assert ok.status_code == 200, ok.text
        events = await _log(c, rid)
        assert [e["event"] for e in events].count("calls_added") == 1
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["run"]["status"] == "done"


async def test_a_cancel_racing_calls_inputs_and_a_close_ends_the_log(tmp_path) -> None:
    """Nothing is recorded after run_finished: the calls' request either took effect
    before the cancel (200, its events first) or finds the run cancelled (409)."""
    async with native_app(tmp_path) as (c, rt):
        outcomes = set()
        for i in range(8):
            body = run_body(
                {"name": "w", "template": "Echo {{input:y}} {{output:oy}}"},
                {"name": "g", "template": "Tell {{input:x}} {{output:og}}"},
                inputs={"x": "dogs"},
                open=True,
            )
            rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
            more = {
                "calls": [{"name": "a", "template": "More {{input:y}} {{output:oa}}"}],
                "inputs": {"y": "v"},
                "close": True,
            }
            calls = c.post(f"/v1/runs/{rid}/calls", json=more)
            cancel = c.post(f"/v1/runs/{rid}/cancel")
            if i % 2:  # either request first
                added, cancelled = await asyncio.gather(calls, cancel)
            else:
                cancelled, added = await asyncio.gather(cancel, calls)
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            assert cancelled.json()["open"] is False
            assert added.status_code in (200, 409), added.text
            outcomes.add(added.status_code)
            events = await _log(c, rid)
            assert [e["event"] for e in events].count("run_finished") == 1
            last = int(events[-1]["id"])
            later = sse_events((await c.get(f"/v1/runs/{rid}/events", params={"after": last})).text)
            assert later == [], later  # nothing after the end
            detail = (await c.get(f"/v1/runs/{rid}")).json()
            assert detail["run"]["status"] == "cancelled"
            ready_y = detail["variables"].get("y", {}).get("status") == "ready"
            assert ready_y == (added.status_code == 200)
        assert outcomes


async def test_two_cancels_at_once_both_answer_cancelled(tmp_path) -> None:
    async with native_app(tmp_path) as (c, rt):
        for _ in range(6):
            body = run_body({"name": "g", "template": "Tell {{input:x}} {{output:og}}"}, open=True)
            rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
            pending = (await c.get(f"/v1/runs/{rid}")).json()["run"]
            assert pending["open"] is True  # not started, still takes inputs and calls
            answers = await asyncio.gather(*(c.post(f"/v1/runs/{rid}/cancel") for _ in range(2)))
            for r in answers:
                assert r.status_code == 200
                assert r.json()["status"] == "cancelled" and r.json()["open"] is False
