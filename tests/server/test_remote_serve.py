"""`serve` with two remote engine processes: prefix locality, and an engine killed mid-run
loses no run (its calls run elsewhere; outputs equal a replay on the survivors)."""

from __future__ import annotations

import signal
import time

import httpx

from .test_recovery_process import Serve, detail
from .test_remote_engine import STARTUP_S, EngineProcess
from .test_remote_engine_registry import OP, OPERATOR_KEY

SYSTEM = "You are a careful assistant. Answer in a few words, plainly and politely. "


def one_call(question: str) -> dict:
    return {
        "program": {
            "calls": [
                {
                    "name": "c",
                    "template": SYSTEM + "Q: {{input:q}} A: {{output:a}}",
                    "outputs": {"a": {"max_tokens": 4}},
                }
            ]
        },
        "inputs": {"q": question},
        "outputs": {"a": "latency"},
    }


def fan_out() -> dict:
    calls = [
        {
            "name": f"w{i}",
            "template": f"Worker {i} writes about {{{{input:t}}}}: {{{{output:p{i}}}}}",
            "outputs": {f"p{i}": {"max_tokens": 96}},
        }
        for i in range(4)
    ]
    parts = " ".join(f"{{{{input:p{i}}}}}" for i in range(4))
    calls.append(
        {
            "name": "merge",
            "template": f"Merge {parts} into {{{{output:m}}}}",
            "outputs": {"m": {"max_tokens": 8}},
        }
    )
    return {"program": {"calls": calls}, "inputs": {"t": "parrots"}, "outputs": {"m": "latency"}}


def value(url: str, run_id: str, name: str) -> str:
    r = httpx.get(
        f"{url}/v1/runs/{run_id}/variables/{name}",
        params={"timeout": 120, "perf": "latency"},
        timeout=130,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.get("status", "ready") == "ready", body
    return body["value"]


def engines(url: str) -> set[str]:
    r = httpx.get(f"{url}/v1/engines", headers=OP, timeout=10)
    assert r.status_code == 200, r.text
    return {e["engine_id"] for e in r.json()}


def wait_for(predicate, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_remote_engines_share_prefixes_and_survive_an_engine_death(tiny_model_dir, tmp_path):
    serve = Serve(tiny_model_dir, tmp_path, None)
    serve.cmd += ["--operator-key", OPERATOR_KEY]
    url = serve.start()
    # the server tuned its garbage collector once start-up was over
    assert "generation-0 threshold 10000 (was " in serve.log.read_text()
    procs = [
        EngineProcess(
            tiny_model_dir,
            tmp_path,
            "--manager",
            url,
            "--manager-key",
            OPERATOR_KEY,
            "--engine-id",
            eid,
        )
        for eid in ("r1", "r2")
    ]
    try:
        wait_for(lambda: engines(url) == {"r1", "r2"})
        # prefix locality: later runs with the same system prompt follow its holder
        holders = []
        for q in ("What is a parrot?", "Where do parrots live?", "Do parrots talk?"):
            run_id = httpx.post(f"{url}/v1/runs", json=one_call(q), timeout=30).json()["run_id"]
            value(url, run_id, "a")
            holders.append(detail(url, run_id)["calls"][0]["engine"])
        assert len(set(holders)) == 1, holders

        # an engine dies while it runs calls of a run: the run still finishes
        run_id = httpx.post(f"{url}/v1/runs", json=fan_out(), timeout=30).json()["run_id"]

        by_id = dict(zip(("r1", "r2"), procs, strict=True))

        def running_remotely() -> str | None:
            for call in detail(url, run_id)["calls"]:
                if call["status"] in ("claimed", "running") and call["engine"] in by_id:
                    return call["engine"]
            return None

        victim = None
        while victim is None:
            wait_for(lambda: running_remotely() is not None, 60)
            # freeze both engines, let the server take in what they sent, and kill one
            # that still holds an unfinished call (a call seen running may have ended
            # since: a loaded machine polls slowly)
            for p in procs:
                p.proc.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
            victim = running_remotely()
            if victim is not None:
                by_id[victim].kill()
            for p in procs:
                if p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGCONT)
            assert victim is not None or detail(url, run_id)["run"]["status"] != "done"
        merged = value(url, run_id, "m")
        # the run ends just after its last value is committed
        wait_for(lambda: detail(url, run_id)["run"]["status"] == "done", 30)
        final = detail(url, run_id)
        assert all(c["engine"] != victim for c in final["calls"])
        assert max(c["attempts"] for c in final["calls"]) >= 2  # some call ran again
        wait_for(lambda: victim not in engines(url), 30)
        # greedy outputs equal a replay of the same run on the engines that are left
        again = httpx.post(f"{url}/v1/runs/{run_id}/replay", json={}, timeout=30)
        assert again.status_code in (200, 201), again.text
        assert value(url, again.json()["run_id"], "m") == merged
    finally:
        for proc in procs:
            proc.kill()
        serve.stop()
