"""/metrics exports the manager's queue and load when the app serves native runs."""

from __future__ import annotations

from .native_support import native_app, run_body
from .test_native_api import CHAIN


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_metrics_count_dispatched_calls_and_shared_prefix_use(tmp_path):
    async with native_app(tmp_path) as (c, _):
        before = (await c.get("/metrics")).text
        assert _value(before, "parrot_manager_calls_dispatched_total") == 0
        rid = (await c.post("/v1/runs", json=run_body(*CHAIN, inputs={"x": "go"},
                                                     outputs={"z": "latency"}))).json()["run_id"]
        assert (await c.get(f"/v1/runs/{rid}/variables/z", params={"timeout": 10})).status_code \
            == 200
        after = (await c.get("/metrics")).text
    assert _value(after, "parrot_manager_calls_dispatched_total") == len(CHAIN)
    assert _value(after, "parrot_manager_pending_calls") == 0
    assert _value(after, "parrot_manager_engines") == 1
