"""A call whose text is all known when it is submitted (its template and its inputs'
values) and cannot fit the model's context is a 400 naming it, at every way in: a new
run, calls added to an open run, an input set later. Nothing is recorded; before, the
run was accepted and the call failed when it ran. A text longer in bytes than the
context whose tokens fit still runs. Real engine on the tiny model (context 512)."""

from __future__ import annotations

import pytest

from parrot_backend.engine.engine import Engine

from .native_support import native_app, run_body, sse_events

pytestmark = pytest.mark.timeout(180)

LONG = "parrot " * 600  # ~600 tokens, more than the tiny model's 512
FITS = "Parrots talk. " * 60  # 840 bytes, more than 512; ~180 tokens


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    assert engine.max_model_len == 512
    assert len(engine.tokenize(LONG)) > 512 > len(engine.tokenize(FITS))
    return engine


@pytest.fixture
async def engine(loaded):
    await loaded.start()
    yield loaded
    await loaded.stop()


def call(template: str, name: str = "c", **outputs) -> dict:
    return {"name": name, "template": template, "outputs": outputs or {"y": {"max_tokens": 2}}}


async def runs_of(c) -> list[str]:
    return [r["run_id"] for r in (await c.get("/v1/runs")).json()["runs"]]


async def test_a_new_run_whose_call_cannot_fit_is_a_400_and_leaves_nothing(engine, tmp_path):
    async with native_app(tmp_path, engine=engine) as (c, _):
        bodies = [
            run_body(call(LONG + "{{output:y}}")),  # the template alone
            run_body(call("Say {{input:x}}{{output:y}}"), inputs={"x": LONG}),  # a value
            # the prompt fits; with the text between the outputs it does not
            run_body(
                call(FITS + "{{output:y}}" + LONG + "{{output:z}}", y={}, z={"max_tokens": 1})
            ),
        ]
        for body in bodies:
            r = await c.post("/v1/runs", json=body)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "call 'c' needs at least" in message and "context holds 512" in message
        assert await runs_of(c) == []


async def test_a_long_text_whose_tokens_fit_runs(engine, tmp_path):
    async with native_app(tmp_path, engine=engine) as (c, _):
        r = await c.post("/v1/runs", json=run_body(call(FITS + "{{output:y}}")))
        assert r.status_code == 201, r.text
        events = sse_events((await c.get(f"/v1/runs/{r.json()['run_id']}/events")).text)
    assert events[-1]["data"]["status"] == "finished"


async def test_added_calls_and_later_inputs_are_checked_too(engine, tmp_path):
    async with native_app(tmp_path, engine=engine) as (c, _):
        body = run_body(call("Say {{input:x}}{{output:y}}"), open=True)
        rid = (await c.post("/v1/runs", json=body)).json()["run_id"]
        # an input whose value makes a waiting call too long: refused, not set
        r = await c.put(f"/v1/runs/{rid}/variables/x", json={"value": LONG})
        assert r.status_code == 400 and "call 'c' needs at least" in r.json()["error"]["message"]
        # added calls: one too long by its template, one by an input given with it
        for calls, inputs in (
            ([call(LONG + "{{output:w}}", "d", w={})], {}),
            ([call("{{input:q}}{{output:w}}", "d", w={})], {"q": LONG}),
            ([], {"x": LONG}),  # the input only, read by the run's call
        ):
            r = await c.post(f"/v1/runs/{rid}/calls", json={"calls": calls, "inputs": inputs})
            assert r.status_code == 400, r.text
            assert "needs at least" in r.json()["error"]["message"]
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert [k["name"] for k in detail["calls"]] == ["c"]
        assert detail["run"]["status"] in ("pending", "running") and detail["run"]["open"]
        assert "x" not in detail["inputs"] and "q" not in detail["inputs"]
        # the run goes on with values that fit
        r = await c.post(
            f"/v1/runs/{rid}/calls",
            json={"calls": [call("{{input:q}}{{output:w}}", "d", w={})], "inputs": {"q": FITS}},
        )
        assert r.status_code == 200, r.text
        assert (await c.put(f"/v1/runs/{rid}/variables/x", json={"value": "hi"})).status_code in (
            200,
            204,
        )
        assert (await c.post(f"/v1/runs/{rid}/close")).status_code in (200, 204)
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    assert events[-1]["data"]["status"] == "finished"
    assert not [e for e in events if e["event"] == "call_failed"]
