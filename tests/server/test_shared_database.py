"""Two `serve` processes on one database: a run is run by its owner only; when the owner
dies, the other adopts the run (ready values kept) and finishes it."""

from __future__ import annotations

import time

import httpx
import pytest

from .serve_process import Serve
from .test_recovery_process import NO_DRAFTS, detail, read_events, ready

CALLS = 12  # the recovery chain twice over, with longer outputs: the run outlives the
# checks below (~1.5 s before the kill; on a fast host 6 calls of 200 tokens took ~3 s)


def long_chain() -> dict:
    """The recovery chain's calls, `CALLS` of them, 200 tokens each."""
    calls = [
        {
            "name": f"c{i}",
            "template": f"Step {i} of the story. {{{{input:x{i}}}}} then {{{{output:x{i + 1}}}}}",
            "outputs": {f"x{i + 1}": {"max_tokens": 200, "temperature": 0.0}},
        }
        for i in range(CALLS)
    ]
    return {
        "program": {"calls": calls},
        "inputs": {"x0": "Once upon a time"},
        "outputs": {f"x{CALLS}": "latency"},
    }


def _resumes(url: str, run_id: str) -> int:
    return sum(e.get("event") == "run_resumed" for e in read_events(url, run_id, None, 1.0))


def test_a_live_owner_keeps_its_run_and_a_dead_ones_run_is_adopted(tiny_model_dir, tmp_path):
    shared_database(tiny_model_dir, tmp_path, None)  # same data dir: one SQLite file


@pytest.mark.postgres
def test_two_servers_share_one_postgresql(tiny_model_dir, tmp_path, pg_database):  # noqa: F811
    shared_database(tiny_model_dir, tmp_path, pg_database)


def shared_database(tiny_model_dir, tmp_path, url: str | None) -> None:
    a = Serve(tiny_model_dir, tmp_path, url, args=NO_DRAFTS)
    b = Serve(tiny_model_dir, tmp_path, url, args=NO_DRAFTS)
    a.cmd[a.cmd.index("--worker-id") + 1] = "server-a"
    b.cmd[b.cmd.index("--worker-id") + 1] = "server-b"
    # (renewed every third of it: a loaded machine may hold A's renewal a few seconds)
    a.cmd += ["--run-lease", "8"]
    b.cmd += ["--run-lease", "8"]
    try:
        url_a, url_b = a.start(), b.start()
        run_id = httpx.post(f"{url_a}/v1/runs", json=long_chain(), timeout=30).json()["run_id"]
        deadline = time.monotonic() + 60
        while not ready(detail(url_a, run_id)) and time.monotonic() < deadline:
            time.sleep(0.02)
        # B's adoption rounds (every second) see A's live lease: B leaves the run alone
        assert _resumes(url_b, run_id) == 0
        kept = ready(detail(url_b, run_id))
        a.kill()  # mid-run
        assert kept and detail(url_b, run_id)["run"]["status"] in ("pending", "running")
        r = httpx.get(
            f"{url_b}/v1/runs/{run_id}/variables/x{CALLS}", params={"timeout": 120}, timeout=130
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30  # the run ends just after its last value
        while detail(url_b, run_id)["run"]["status"] != "done" and time.monotonic() < deadline:
            time.sleep(0.05)
        final = detail(url_b, run_id)
        assert final["run"]["status"] == "done"
        assert _resumes(url_b, run_id) == 1  # adopted once, by B
        for name, (value, set_at) in kept.items():  # ready values were not recomputed
            assert ready(final)[name] == (value, set_at)
        again = httpx.post(f"{url_b}/v1/runs/{run_id}/replay", json={}, timeout=30).json()
        r2 = httpx.get(
            f"{url_b}/v1/runs/{again['run_id']}/variables/x{CALLS}",
            params={"timeout": 120},
            timeout=130,
        )
        assert r2.json()["value"] == r.json()["value"]  # equal to an uninterrupted run
    finally:
        a.stop()
        b.stop()
