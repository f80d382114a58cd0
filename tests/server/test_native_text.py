"""Text the store cannot hold never reaches it: lone surrogates and NUL anywhere in a
request, names longer than the store's columns, malformed path parameters are clear
400s on SQLite and PostgreSQL, and nothing stored afterwards is unreadable. A NUL that
the *engine* generates is stored and read back as it was (PostgreSQL escapes it).

Before: `"\\ud800"` in inputs, values, replay or workflow inputs and templates gave
UnicodeEncodeError 500s; a workflow holding one made `GET /v1/workflows` a 500 for its
tenant forever, and a run created with `"\\udc80 {{output:o}}"` answered 201 and then
its detail was a 500 forever; on PostgreSQL NUL and names over 200 characters gave 500s.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from parrot_backend.store import upgrade
from parrot_backend.testing.fake_engine import ScriptedEngine

from .native_support import native_app, run_body, sse_events

PG_ENV = "PARROT_TEST_DATABASE_URL"
A = {"name": "a", "template": "Start {{input:x}} {{output:y}}"}
OPEN_A = run_body(A, open=True)
SURROGATE, NUL = "\ud800", "\x00"
LONG = "v" * 201


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request, tmp_path_factory):
    """None (a fresh SQLite file per test) or a migrated PostgreSQL schema."""
    if request.param == "sqlite":
        yield None
        return
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} unset")
    schema = f"parrot_txt_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    url = url.render_as_string(hide_password=False)
    upgrade(url)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _raw(body: object) -> bytes:
    # json.dumps escapes lone surrogates as \\ud800, exactly what a client would send
    return json.dumps(body).encode()


def _cases(bad: str) -> list[tuple[str, str, str, object]]:
    return [
        ("input value", "POST", "/v1/runs", run_body(A, inputs={"x": f"go{bad}"})),
        ("input name", "POST", "/v1/runs", run_body(A, inputs={"x": "go", f"x{bad}": "1"})),
        ("template", "POST", "/v1/runs", run_body({"template": f"{bad} {{{{output:o}}}}"})),
        (
            "stop string",
            "POST",
            "/v1/runs",
            run_body({"template": "Q {{output:o}}", "outputs": {"o": {"stop": [bad]}}}),
        ),
        ("set value", "PUT", "/v1/runs/{open}/variables/x", {"value": f"v{bad}"}),
        (
            "added template",
            "POST",
            "/v1/runs/{open}/calls",
            {"calls": [{"template": f"{{{{input:y}}}}{bad} {{{{output:z}}}}"}]},
        ),
        ("replay input", "POST", "/v1/runs/{done}/replay", {"inputs": {"x": f"r{bad}"}}),
        (
            "workflow program",
            "POST",
            "/v1/workflows",
            {"name": "w", "program": {"calls": [{"template": f"{bad}{{{{output:o}}}}"}]}},
        ),
        ("workflow run input", "POST", "/v1/workflows/good/runs", {"inputs": {"x": bad}}),
    ]


NAME_CASES = [
    ("long call name", "POST", "/v1/runs", run_body({"name": LONG, "template": "Q {{output:o}}"})),
    (
        "long variable in template",
        "POST",
        "/v1/runs",
        run_body({"template": f"Q {{{{output:{LONG}}}}}"}),
    ),
    ("long input name, open run", "POST", "/v1/runs", run_body(A, inputs={LONG: "1"}, open=True)),
    (
        "long output name, open run",
        "POST",
        "/v1/runs",
        run_body(A, outputs={LONG: "latency"}, open=True),
    ),
    ("long workflow name", "POST", "/v1/workflows", {"name": "w" * 201, "program": {"calls": [A]}}),
    ("set an invalid name", "PUT", "/v1/runs/{open}/variables/a%20b", {"value": "v"}),
    ("set a long name", "PUT", f"/v1/runs/{{open}}/variables/{LONG}", {"value": "v"}),
    ("poll an invalid name", "GET", "/v1/runs/{done}/variables/a%20b?timeout=0", None),
    ("run id with NUL", "GET", "/v1/runs/%00", None),
    ("run id not hex", "GET", "/v1/runs/ZZZZ", None),
    ("events of a bad id", "GET", "/v1/runs/x%00y/events", None),
    ("cancel a bad id", "POST", "/v1/runs/%ff/cancel", None),
    ("workflow name with NUL", "POST", "/v1/workflows/w%00/runs", {"inputs": {}}),
]


async def _setup(c) -> dict[str, str]:
    ids = {
        "done": (await c.post("/v1/runs", json=run_body(A, inputs={"x": "go"}))).json()["run_id"]
    }
    sse_events((await c.get(f"/v1/runs/{ids['done']}/events")).text)
    ids["open"] = (await c.post("/v1/runs", json=OPEN_A)).json()["run_id"]
    r = await c.post("/v1/workflows", json={"name": "good", "program": {"calls": [A]}})
    assert r.status_code == 201, r.text
    return ids


async def _still_readable(c, ids) -> None:
    for path in ("/v1/workflows", "/v1/runs", f"/v1/runs/{ids['done']}", f"/v1/runs/{ids['open']}"):
        r = await c.get(path)
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("bad", [SURROGATE, "\udc80", NUL], ids=["d800", "dc80", "nul"])
async def test_unstorable_text_is_a_400_that_names_it(tmp_path, database, bad):
    async with native_app(tmp_path, url=database) as (c, _):
        ids = await _setup(c)
        for what, method, path, body in _cases(bad):
            r = await c.request(
                method,
                path.format(**ids),
                content=_raw(body),
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 400, (what, r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert "surrogate" in message or "NUL" in message, (what, message)
        await _still_readable(c, ids)


async def test_names_and_path_parameters_the_store_cannot_hold_are_400s(tmp_path, database):
    async with native_app(tmp_path, url=database) as (c, _):
        ids = await _setup(c)
        for what, method, path, body in NAME_CASES:
            r = await c.request(method, path.format(**ids), json=body)
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
            assert r.json()["error"]["message"], what
        await _still_readable(c, ids)


async def test_a_generated_nul_is_stored_and_read_back_unchanged(tmp_path, database):
    reply = "a\x00b \\0 \x01parrot:nul\x01 c"  # NUL, an escape look-alike, the marker

    engine = ScriptedEngine(reply=lambda prompt: reply)
    async with native_app(tmp_path, url=database, engine=engine) as (c, _):
        rid = (await c.post("/v1/runs", json=run_body(A, inputs={"x": "go"}))).json()["run_id"]
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        assert events[-1]["data"]["status"] == "finished"
        r = await c.get(f"/v1/runs/{rid}/variables/y")
        assert r.status_code == 200 and r.json()["value"] == reply
        detail = (await c.get(f"/v1/runs/{rid}")).json()
        assert detail["variables"]["y"]["value"] == reply
        tokens = "".join(e["data"]["text"] for e in events if e["event"] == "token")
        assert tokens == reply
