"""Prefill tokens a native run and its replay compute (`/metrics`), against a running server.

    .venv/bin/parrot-backend serve --port 8000 &
    .venv/bin/python benchmarks/results/fork-cache/replay_check.py

A program of four one-sentence summaries (each call forks the shared instruction prefix;
the four documents share a long common start), run once and replayed; prints the prefill
tokens each computed and the outputs.
"""

from __future__ import annotations

import re
import time

import httpx

c = httpx.Client(base_url="http://127.0.0.1:8000", timeout=120)
DOC = " ".join(f"Parrots live in flocks and eat seeds; fact number {i}." for i in range(20))
TEMPLATE = (
    "You summarise documents in one sentence.\nDocument: {{input:d%d}}\nSummary:{{output:s%d}}"
)


def prefill() -> float:
    text = c.get("/metrics").text
    return float(re.search(r"^parrot_engine_prefill_tokens_computed_total (\S+)", text, re.M)[1])


def run(url: str, body: dict) -> tuple[str, float]:
    before = prefill()
    rid = c.post(url, json=body).json()["run_id"]
    for i in range(4):
        c.get(f"/v1/runs/{rid}/variables/s{i}", params={"timeout": 60})
    time.sleep(0.5)  # the last call's end is recorded
    return rid, prefill() - before


calls = [
    {"name": f"m{i}", "template": TEMPLATE % (i, i), "outputs": {f"s{i}": {"max_tokens": 16}}}
    for i in range(4)
]
body = {
    "program": {"calls": calls},
    "inputs": {f"d{i}": f"{DOC} Variant {i}." for i in range(4)},
    "outputs": {f"s{i}": "latency" for i in range(4)},
}
rid, first = run("/v1/runs", body)
_, again = run(f"/v1/runs/{rid}/replay", {})
print(f"original run: {first:.0f} prefill tokens computed; replay: {again:.0f}")
print([c.get(f"/v1/runs/{rid}/variables/s{i}").json()["value"] for i in range(4)])
