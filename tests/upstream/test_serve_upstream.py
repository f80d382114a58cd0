"""`parrot-backend serve --upstream URL` as a real process in front of the session's llama.cpp.

With `--no-local-engine` the upstream is the only engine: a native map-reduce run through
the HTTP API gives llama.cpp's own answers for the same rendered prompts sent alone (the
oracle of test_manager_on_llama), every call runs on `upstream-0`, and the server's
OpenAI-compatible completions run on the upstream too. Mixed with an in-process engine
(the tiny random model: SmolLM2's tokenizer, checked against llama.cpp's /tokenize at
start) the server starts with both and runs a program.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server.serve_process import Serve

from .programs import chain, map_reduce
from .test_manager_on_llama import assert_llama_agrees

pytestmark = pytest.mark.slow


def run_values(url: str, spec) -> tuple[dict[str, str], list[str]]:
    """Submit `spec` as a native run; (every value, the engine of each call_started)."""
    body = spec.model_dump(mode="json", exclude_none=True)
    with httpx.Client(base_url=url, timeout=300) as client:
        created = client.post("/v1/runs", json=body)
        assert created.status_code in (200, 201), created.text
        run_id = created.json()["run_id"]
        program = spec.build()
        values = dict(spec.inputs)
        for call in program.topological_calls():
            for out in program.calls[call].configs:
                while True:  # long-poll until the value is there
                    got = client.get(f"/v1/runs/{run_id}/variables/{out}", params={"timeout": 60})
                    if got.status_code != 408:
                        break
                assert got.status_code == 200, got.text
                assert got.json().get("status") == "ready", got.json()
                values[out] = got.json()["value"]
        events = client.get(f"/v1/runs/{run_id}/events", params={"timeout": 1}).text
    started = [
        json.loads(line[5:])
        for line in events.splitlines()
        if line.startswith("data:") and '"engine"' in line
    ]
    return values, [e["engine"] for e in started if "engine" in e]


@pytest.fixture
def serve_only_upstream(llama_server, tmp_path, tiny_model_dir):
    process = Serve(
        tiny_model_dir,
        tmp_path,
        None,
        args=["--no-local-engine", "--upstream", llama_server.url + "/v1"],
    )
    process.start()
    yield process
    process.stop()


def test_serve_no_local_engine_runs_programs_on_llama_cpp(
    serve_only_upstream, llama_server
) -> None:
    job = map_reduce(3)
    got, engines = run_values(serve_only_upstream.url, job)
    assert_llama_agrees(llama_server.url, job, got)
    assert engines and set(engines) == {"upstream-0"}
    # the OpenAI-compatible API runs on the upstream as well
    model = httpx.get(serve_only_upstream.url + "/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": "The three primary colors are",
        "max_tokens": 12,
        "temperature": 0,
    }
    ours = httpx.post(serve_only_upstream.url + "/v1/completions", json=body, timeout=120)
    direct = httpx.post(
        llama_server.url + "/v1/completions", json=body | {"cache_prompt": False}, timeout=120
    )
    assert ours.status_code == 200, ours.text
    assert ours.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


def test_serve_mixes_the_in_process_engine_and_an_upstream(
    llama_server, tmp_path, tiny_model_dir
) -> None:
    process = Serve(tiny_model_dir, tmp_path, None, args=["--upstream", llama_server.url + "/v1"])
    process.start()
    try:
        got, engines = run_values(process.url, chain(max_tokens=6))
        assert set(got) >= {"idea", "draft", "title"}
        assert set(engines) <= {"engine-0", "upstream-0"} and len(engines) == 3
    finally:
        process.stop()
    log = process.log.read_text()
    assert re.search(r"upstream-0: UpstreamEngine\('" + re.escape(llama_server.url), log)
