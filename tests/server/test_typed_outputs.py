"""Typed semantic variables through the native API on the tiny random model: a typed
output's value matches its json_schema / regex / choice, the store records the type, a
downstream call receives the value as text, a value cut by max_tokens fails its call
instead of being set, and bad types are 400s naming the output."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import pytest
from sqlalchemy import text

from parrot_backend.engine.engine import Engine
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.runtime import NativeRuntime
from parrot_backend.store import Store

from .native_support import migrated_sqlite, sse_events

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["bird", "red", "loud"]}},
    },
}
LABELS = ["parrot", "crow", "owl"]
CODE = r"[A-Z]{2}-[0-9]{3}"


@pytest.fixture
async def real(tiny_model_dir, tmp_path):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    store = Store(migrated_sqlite(tmp_path))
    runtime = NativeRuntime(store, {"e0": engine}, worker="typed-test")
    app = create_app(engine, settings=ServerSettings(), native=runtime)
    await engine.start()
    await runtime.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120
        ) as c:
            yield c, engine, store
    finally:
        await runtime.stop()
        await engine.stop()
        store.close()


def _program(max_tokens: int = 96) -> dict:
    return {
        "calls": [
            {
                "name": "extract",
                "template": "Describe {{input:animal}} as JSON: {{output:data}}",
                "outputs": {"data": {"json_schema": SCHEMA, "max_tokens": max_tokens}},
            },
            {
                "name": "pick",
                "template": "Which bird is {{input:animal}}? {{output:label}}",
                "outputs": {"label": {"choice": LABELS, "temperature": 1.0, "seed": 3}},
            },
            {
                "name": "code",
                "template": "Code for {{input:animal}}: {{output:code}}",
                "outputs": {"code": {"regex": CODE}},
            },
            {
                "name": "use",
                "template": "Data: {{input:data}} Label: {{input:label}} =>{{output:summary}}",
                "outputs": {"summary": {"max_tokens": 8}},
            },
        ]
    }


async def _run(c, program: dict) -> tuple[str, list[dict], dict]:
    r = await c.post("/v1/runs", json={"program": program, "inputs": {"animal": "a macaw"}})
    assert r.status_code == 201, r.text
    rid = r.json()["run_id"]
    events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    detail = (await c.get(f"/v1/runs/{rid}")).json()
    return rid, events, detail["variables"]


async def test_typed_values_match_and_reach_downstream_calls_as_text(real):
    c, engine, store = real
    rid, events, variables = await _run(c, _program())
    assert events[-1]["data"]["status"] == "finished", events[-3:]
    values = {n: v["value"] for n, v in variables.items()}
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(values["data"]))
    assert values["label"] in LABELS
    assert re.fullmatch(CODE, values["code"])
    with store.engine.connect() as conn:
        types = dict(
            conn.execute(
                text("SELECT name, type FROM variables WHERE run_id = :r"), {"r": rid}
            ).all()
        )
    assert types == {
        "animal": "text",
        "data": "json_schema",
        "label": "choice",
        "code": "regex",
        "summary": "text",
    }
    assert {n: v["type"] for n, v in variables.items()} == types  # the API shows them
    r = await c.get(f"/v1/runs/{rid}/variables/data")
    assert r.json()["type"] == "json_schema"
    # the downstream call saw the values as plain text: the same prompt sent whole to the
    # request-level route generates the same summary
    prompt = f"Data: {values['data']} Label: {values['label']} =>"
    r = await c.post(
        "/v1/completions",
        json={"model": engine.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == values["summary"]


async def test_a_typed_value_cut_by_max_tokens_fails_its_call(real):
    c, _, store = real
    rid, events, variables = await _run(c, _program(max_tokens=3))
    assert events[-1]["data"]["status"] == "failed"
    assert variables["data"]["status"] == "failed" and variables["data"]["value"] is None
    assert "not complete after 3 tokens" in variables["data"]["error"]
    assert variables["code"]["status"] == "ready"  # the other calls are unaffected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "does not support: uniqueItems"),
        ({"json_schema": {"type": "bogus"}}, "Invalid type: bogus"),
        ({"regex": "[a-z"}, "unclosed character class"),
        ({"choice": []}, "at least 1 item"),
        ({"choice": ["a"], "regex": "a"}, "at most one of json_schema, regex and choice"),
        ({"regex": "[0-9]+", "stop": ["\n"]}, "stop cannot be combined with regex"),
        ({"json_schema": "not a schema"}, "json_schema"),
    ],
)
async def test_bad_types_are_400s_naming_the_output(real, config, message):
    c, _, _ = real
    program = {
        "calls": [{"name": "c", "template": "x {{output:answer}}", "outputs": {"answer": config}}]
    }
    for route, body in (
        ("/v1/runs", {"program": program}),
        ("/v1/workflows", {"name": "w", "program": program}),
    ):
        r = await c.post(route, json=body)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]["message"]
        assert "outputs.answer" in error and message in error, error
