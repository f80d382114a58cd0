"""Schema-driven fuzzing of the native API (`/v1/runs...`, `/v1/workflows...`): schemathesis
generates valid and invalid requests from /openapi.json; none may produce a 5xx or hang.

The native runtime must run on the loop that serves the requests (its manager, persister
and notifier are asyncio objects bound to it), so the app is served by a real uvicorn on
127.0.0.1 in a thread, whose lifespan starts the runtime, and schemathesis sends real HTTP
requests to it (`case.call(base_url=...)`). The schema is read from the app at import
(it does not depend on the store), so each operation is its own test; the server starts
in a module fixture. (`schemathesis.pytest.from_fixture`, which would load it from the
live server, fails on this pytest: it sets `Function._nodeid`, which pytest 9 dropped.)
"""

from __future__ import annotations

import itertools
import math
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, seed, settings

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import InvalidArgument  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.errors import InvalidSchema  # noqa: E402
from schemathesis.generation.jsonschema import strategy as _st_strategy  # noqa: E402

from parrot_backend.server import ServerSettings, create_app  # noqa: E402
from parrot_backend.server.runtime import NativeRuntime  # noqa: E402
from parrot_backend.store import Store  # noqa: E402
from parrot_backend.testing.fake_engine import ScriptedEngine  # noqa: E402

from .conftest import LiveServer  # noqa: E402
from .native_support import ALICE, KEYS, echo, migrated_sqlite, run_body  # noqa: E402


def _demands_none_can_meet(repeated):
    """schemathesis 4.32's negative mode negates a whole body (`not: RunSpec`); the negation
    of `ProgramSpec.calls` holds an array `contains` demand whose element has no values. Its
    `_repeated` then raises InvalidSchema ("Cannot generate an array with 1 demanded
    elements", from Hypothesis's "Cannot create non-empty lists with elements drawn from
    strategy nothing()") instead of giving `st.nothing()` as it does for the same
    contradiction outside a `$ref` cycle (its `ctx.building_cycle` skips that check). The
    error ends the whole operation's test, so POST /v1/runs was fuzzed in some runs and
    failed in others (which draw meets it depends on strategy caches shared across
    operations). Here exactly that case declines the layout, as schemathesis's own check
    would; any other InvalidSchema still raises."""

    def wrapped(placement, ctx, *, unique):
        try:
            return repeated(placement, ctx, unique=unique)
        except InvalidSchema as exc:
            cause = exc.__cause__
            if isinstance(cause, InvalidArgument) and "nothing()" in str(cause):
                return st.nothing()
            raise

    return wrapped


if hasattr(_st_strategy, "_repeated"):  # a later schemathesis may have fixed or renamed it
    _st_strategy._repeated = _demands_none_can_meet(_st_strategy._repeated)

A = {"name": "a", "template": "Start {{input:x}} {{output:y}}"}
POLL_S = 0.2  # long-polls wait at most this long: a pending variable answers 408 quickly
HTTP_TIMEOUT_S = 20  # a request still unanswered after this is a hang (a failure)
ANSWERS: Counter[tuple[str, int]] = Counter()  # (operation, status) of every fuzz request


class Seeded:
    """The live server and the runs and workflows seeded before fuzzing, so that generated
    requests reach real runs (random run ids would all stop at the 404)."""

    def __init__(self, live: LiveServer, engine: ScriptedEngine) -> None:
        self.live = live
        self.engine = engine
        self.url = live.url
        http = requests.Session()
        http.headers.update(ALICE)
        self.http = http

        def create(body: dict) -> str:
            r = http.post(f"{self.url}/v1/runs", json=body, timeout=HTTP_TIMEOUT_S)
            assert r.status_code == 201, r.text
            return r.json()["run_id"]

        # finished: its event stream ends, so the SSE route can be fuzzed on it
        self.done = create(run_body(A, inputs={"x": "go"}))
        r = http.get(f"{self.url}/v1/runs/{self.done}/events", timeout=HTTP_TIMEOUT_S)
        assert "run_finished" in r.text
        # open with its input unset: set/close/add-calls can succeed on it
        self.open = create(run_body(A, open=True))
        # open with its input set: its call runs, so polls and cancels meet a live run
        self.open_set = create(run_body(A, inputs={"x": "go"}, open=True))
        r = http.post(
            f"{self.url}/v1/workflows",
            timeout=HTTP_TIMEOUT_S,
            json={"name": "good", "program": {"calls": [A]}},
        )
        assert r.status_code == 201, r.text
        # no inputs: generated bodies with no (or empty) inputs start it
        r = http.post(
            f"{self.url}/v1/workflows",
            timeout=HTTP_TIMEOUT_S,
            json={"name": "plain", "program": {"calls": [{"template": "Q {{output:y}}"}]}},
        )
        assert r.status_code == 201, r.text
        # generated ids are kept one time in three: unknown runs must answer 404 too
        self.run_ids = itertools.cycle([None, self.done, self.open, None, self.open_set, self.done])
        self.finished_ids = itertools.cycle([None, self.done])
        self.var_names = itertools.cycle([None, "x", "y"])
        self.workflow_names = itertools.cycle([None, "good", "plain"])


# Built at import, as `schema.parametrize` needs the schema then (one test per
# operation); the store is a copy of an already migrated SQLite file, so this is cheap.
TMP = Path(tempfile.mkdtemp(prefix="parrot-fuzz-native-"))
ENGINE = ScriptedEngine(reply=echo)
STORE = Store(migrated_sqlite(TMP))
RUNTIME = NativeRuntime(STORE, {"e0": ENGINE}, worker="fuzz-worker")
# sse_ping_s: the event streams fuzzed end by themselves; no ping is needed meanwhile
APP = create_app(
    ENGINE,
    native=RUNTIME,
    settings=ServerSettings(api_keys=dict(KEYS), key_lookup=RUNTIME.key_lookup, sse_ping_s=15),
)
schema = schemathesis.openapi.from_dict(APP.openapi()).include(path_regex=r"^/v1/(runs|workflows)")


@pytest.fixture(scope="module")
def seeded() -> Iterator[Seeded]:
    """Serve APP with uvicorn on a free loopback port for the module, seeded."""
    try:
        with LiveServer(APP) as live:  # uvicorn's lifespan starts RUNTIME on its loop
            yield Seeded(live, ENGINE)
    finally:
        STORE.close()
        shutil.rmtree(TMP, ignore_errors=True)


def _pin(params: dict | None, key: str, choices: Iterator[str | None]) -> None:
    """Replace a generated path parameter by a seeded value, or keep it (None)."""
    if params is not None and key in params:
        value = next(choices)
        if value is not None:
            params[key] = value


def _bounded_poll(query: dict) -> None:
    """Keep long-polls short: a valid `timeout` above POLL_S (or none, i.e. 30 s) becomes
    POLL_S; invalid ones (negative, huge, not a number) are sent as generated."""
    value = query.get("timeout")
    if value is None:
        query["timeout"] = POLL_S
        return
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return
    if math.isfinite(seconds) and POLL_S < seconds <= 300:
        query["timeout"] = POLL_S


@schema.parametrize()
# A fixed seed: the same cases every run. Not `derandomize=True`: its seed is a digest of
# this function's source, so reformatting the file changed the draws. (Those changing draws
# met schemathesis's "Cannot generate an array with 1 demanded elements", now declined by
# `_demands_none_can_meet` above: 0 of 400 seeded draws of all /v1 operations, against 7
# of 40 seeds for POST /v1/runs without it.) Change the seed or widen max_examples locally
# to explore.
@seed(20261202)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_native_no_server_errors(case, seeded: Seeded):
    """No generated request, valid or not, gets a 5xx or goes unanswered."""
    params = case.path_parameters
    if case.path.endswith("/events"):
        # Only finished (or unknown) runs: a live run's stream legitimately never ends.
        # Streams of live runs are covered by test_native_api.py (tokens streamed and
        # resumed with Last-Event-ID, a client leaving mid-stream).
        _pin(params, "run_id", seeded.finished_ids)
    else:
        _pin(params, "run_id", seeded.run_ids)
    if case.path.startswith("/v1/runs/{run_id}/variables/"):
        _pin(params, "name", seeded.var_names)
    if case.path == "/v1/workflows/{name}/runs":
        _pin(params, "name", seeded.workflow_names)
    if case.method.upper() == "GET" and case.path.endswith("/variables/{name}"):
        if case.query is None:
            case.query = {}
        _bounded_poll(case.query)
    response = case.call_and_validate(
        base_url=seeded.url, headers=ALICE, timeout=HTTP_TIMEOUT_S, checks=[not_a_server_error]
    )
    ANSWERS[f"{case.method.upper()} {case.path}", response.status_code] += 1


def test_server_still_serves_after_fuzzing(seeded: Seeded):
    """The server is healthy and its data intact after the fuzz run."""
    # runs after the fuzz cases in this module: the server answers, and the seeded
    # finished run still reads back from the store with its value
    if ANSWERS:  # the fuzz ran (not deselected): it got past validation and the 404s
        assert ANSWERS["POST /v1/runs", 201] > 0
        assert ANSWERS["GET /v1/runs/{run_id}", 200] > 0
    r = requests.get(f"{seeded.url}/healthz", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = seeded.http.get(
        f"{seeded.url}/v1/runs/{seeded.done}/variables/y",
        params={"timeout": 5},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 200 and r.json()["value"] == "<go>", r.text
    assert seeded.engine.generations  # runs reached the engine
