"""Schema-driven fuzzing: schemathesis generates valid and invalid requests for every
operation in /openapi.json (streaming routes included); none may produce a 5xx."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402

from parrot_backend.server import ServerSettings, create_app  # noqa: E402
from parrot_backend.testing.fake_engine import FakeEngine  # noqa: E402

from .conftest import AUTH, KEYS  # noqa: E402

ENGINE = FakeEngine(reply="fuzz")
APP = create_app(ENGINE, settings=ServerSettings(api_keys=dict(KEYS), max_n=4))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    # Random model names would all stop at the 404 check; pin it so that generated bodies
    # reach prompt handling, sampling validation and the engine.
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "fake-model"
    case.call_and_validate(headers=AUTH, checks=[not_a_server_error])


def test_fuzzing_left_nothing_behind():
    # runs after the fuzz cases in this module: valid requests reached the engine, and
    # every context was freed and every slot returned
    assert len(ENGINE.fills) > 5
    assert ENGINE.contexts == {}
    assert APP.state.parrot.limiter.inflight == 0
