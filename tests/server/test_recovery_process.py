"""Crash recovery with a real `serve` process killed by SIGKILL mid-run, several times.

Each life of the server is killed once more generated values are committed (but before
the run's end); the next life resumes the run from SQL. Checked: values committed before
a kill are kept (same value, same `set_at`: never recomputed), the resumed run finishes
with the outputs of an uninterrupted run of the same program (greedy), the SSE log read
across the restarts with `Last-Event-ID` has no gap and no duplicate, and the ids keep
increasing across server lives.
"""

from __future__ import annotations

import time

import httpx
import pytest

from .native_support import sse_events
from .serve_process import Serve

N_CALLS = 6


# the tiny random model's greedy text repeats itself, so drafts would finish its chain in a
# fraction of the steps; these tests need a run that outlives their kills and fault steps
NO_DRAFTS = ["--speculate", "0"]


def chain_spec() -> dict:
    calls = [
        {
            "name": f"c{i}",
            "template": f"Step {i} of the story. {{{{input:x{i}}}}} then {{{{output:x{i + 1}}}}}",
            "outputs": {f"x{i + 1}": {"max_tokens": 64, "temperature": 0.0}},
        }
        for i in range(N_CALLS)
    ]
    return {
        "program": {"calls": calls},
        "inputs": {"x0": "Once upon a time"},
        "outputs": {f"x{N_CALLS}": "latency"},
    }


def detail(url: str, run_id: str) -> dict:
    r = httpx.get(f"{url}/v1/runs/{run_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def ready(d: dict) -> dict[str, tuple[str, str]]:
    """Generated variables that are ready: name -> (value, set_at)."""
    return {
        n: (v["value"], v["set_at"])
        for n, v in d["variables"].items()
        if v["status"] == "ready" and v["producer_call"] is not None
    }


def read_events(url: str, run_id: str, last_id: str | None, seconds: float) -> list[dict]:
    """Read the run's SSE stream (from `last_id`) for up to `seconds` (but until a whole
    event has come, however slow the server) or until it ends."""
    headers = {"Last-Event-ID": last_id} if last_id else {}
    raw = ""
    end = time.monotonic() + seconds
    try:
        with httpx.stream(
            "GET",
            f"{url}/v1/runs/{run_id}/events",
            headers=headers,
            timeout=httpx.Timeout(10, read=max(seconds, 5)),
        ) as r:
            assert r.status_code == 200
            for chunk in r.iter_text():
                raw += chunk
                if time.monotonic() > end and "\n\n" in raw.replace("\r\n", "\n"):
                    break
    except httpx.ReadTimeout:
        pass
    # stopping early can cut the last block: keep whole blocks only
    raw = raw.replace("\r\n", "\n")
    raw = raw[: raw.rfind("\n\n") + 2] if "\n\n" in raw else ""
    return sse_events(raw)


def crash_and_resume(serve: Serve, kills: int) -> None:
    url = serve.start()
    run_id = httpx.post(f"{url}/v1/runs", json=chain_spec(), timeout=30).json()["run_id"]
    seen: dict[str, tuple[str, str]] = {}
    first_life: list[dict] = []
    for life in range(kills):
        # kill once this life committed a value more than the last one did
        deadline = time.monotonic() + 120
        while True:
            d = detail(url, run_id)
            now = ready(d)
            assert d["run"]["status"] != "done", "the run ended before the kill: make it longer"
            if len(now) > len(seen):
                break
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        if life == 0:
            first_life = read_events(url, run_id, None, 0.05)
        serve.kill()
        assert f"x{N_CALLS}" not in now
        for name, value in seen.items():  # kept from earlier lives, not recomputed
            assert now[name] == value
        seen = now
        url = serve.start()
    final = httpx.get(
        f"{url}/v1/runs/{run_id}/variables/x{N_CALLS}", params={"timeout": 120}, timeout=130
    )
    assert final.status_code == 200, final.text
    assert first_life, "no event read before the first kill"
    rest = read_events(url, run_id, first_life[-1]["id"], 60)  # resume across 3 restarts
    events = read_events(url, run_id, None, 60)
    assert first_life + rest == events  # same ids, same events, nothing lost or repeated
    d = detail(url, run_id)
    assert d["run"]["status"] == "done"
    after = ready(d)
    for name, value in seen.items():
        assert after[name] == value
    ids = [int(e["id"]) for e in events]
    assert ids == list(range(1, len(ids) + 1))  # no gap, no duplicate, across lives
    assert events[-1]["event"] == "run_finished"
    assert sum(e["event"] == "run_resumed" for e in events) == kills
    # an uninterrupted run of the same program gives the same outputs (greedy)
    ref = httpx.post(f"{url}/v1/runs/{run_id}/replay", json={}, timeout=30).json()["run_id"]
    httpx.get(f"{url}/v1/runs/{ref}/variables/x{N_CALLS}", params={"timeout": 120}, timeout=130)
    read_events(url, ref, None, 60)
    expected = {n: v for n, (v, _) in ready(detail(url, ref)).items()}
    assert {n: v for n, (v, _) in after.items()} == expected
    assert len(expected) == N_CALLS


def test_sigkill_mid_run_resumes_on_sqlite(tiny_model_dir, tmp_path) -> None:
    serve = Serve(tiny_model_dir, tmp_path, None, args=NO_DRAFTS)
    try:
        crash_and_resume(serve, kills=3)
    finally:
        serve.stop()


@pytest.mark.postgres
def test_sigkill_mid_run_resumes_on_postgresql(tiny_model_dir, tmp_path, pg_database) -> None:
    serve = Serve(tiny_model_dir, tmp_path, pg_database, args=NO_DRAFTS)
    try:
        crash_and_resume(serve, kills=2)
    finally:
        serve.stop()


def engine_dies_and_resumes(serve: Serve) -> None:
    """The engine's loop dies mid-run (injected fault): `serve` exits 1 and fails no call;
    the next start resumes the run, which finishes with an uninterrupted run's outputs."""
    url = serve.start()
    run_id = httpx.post(f"{url}/v1/runs", json=chain_spec(), timeout=30).json()["run_id"]
    assert serve.proc is not None
    code = serve.proc.wait(120)
    assert code == 1, serve.log.read_text()[-3000:]
    serve.env.pop("PARROT_FAULT_ENGINE_STEP")
    url = serve.start()
    final = httpx.get(
        f"{url}/v1/runs/{run_id}/variables/x{N_CALLS}", params={"timeout": 120}, timeout=130
    )
    assert final.status_code == 200, final.text
    events = read_events(url, run_id, None, 60)
    kinds = [e["event"] for e in events]
    assert "call_failed" not in kinds and "variable_failed" not in kinds
    assert kinds.count("run_resumed") == 1 and kinds[-1] == "run_finished"
    d = detail(url, run_id)
    assert d["run"]["status"] == "done"
    ref = httpx.post(f"{url}/v1/runs/{run_id}/replay", json={}, timeout=30).json()["run_id"]
    httpx.get(f"{url}/v1/runs/{ref}/variables/x{N_CALLS}", params={"timeout": 120}, timeout=130)
    read_events(url, ref, None, 60)
    expected = {n: v for n, (v, _) in ready(detail(url, ref)).items()}
    assert {n: v for n, (v, _) in ready(d).items()} == expected
    assert len(expected) == N_CALLS


def test_an_engine_death_fails_no_run_and_the_next_start_resumes_it(
    tiny_model_dir, tmp_path
) -> None:
    # about 64 steps per call: the loop dies during the third call
    serve = Serve(
        tiny_model_dir, tmp_path, None, env={"PARROT_FAULT_ENGINE_STEP": "150"}, args=NO_DRAFTS
    )
    try:
        engine_dies_and_resumes(serve)
    finally:
        serve.stop()


@pytest.mark.postgres
def test_an_engine_death_fails_no_run_on_postgresql(tiny_model_dir, tmp_path, pg_database) -> None:
    serve = Serve(
        tiny_model_dir,
        tmp_path,
        pg_database,
        env={"PARROT_FAULT_ENGINE_STEP": "150"},
        args=NO_DRAFTS,
    )
    try:
        engine_dies_and_resumes(serve)
    finally:
        serve.stop()
