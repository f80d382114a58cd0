"""The SDK over HTTP: the paper's example against a real `serve` process gives the same
values as the in-process backend (greedy), and server refusals surface as ServerError."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.client import (
    HttpBackend,
    InProcessBackend,
    ServerError,
    Session,
    run_sync,
    semantic_function,
)
from parrot_backend.engine.engine import Engine

from .native_support import sse_events
from .test_recovery_process import Serve


@semantic_function(max_tokens=12)
def write_code(task):
    """You are an expert software engineer. Write python code of {{input:task}}.
    Code: {{output:code}}"""


@semantic_function(max_tokens=12)
def write_test(task, code):
    """You are an experienced QA engineer. You write test code for {{input:task}}.
    Code: {{input:code}}. Your test code: {{output:test}}"""


def paper_example(backend) -> tuple[str, str]:
    with Session(backend):
        code = write_code("a snake game")
        test = write_test("a snake game", code)
        return code.get(), test.get(perf="latency")


def test_http_backend_matches_the_in_process_backend(tiny_model_dir, tmp_path):
    local = InProcessBackend.threaded(
        lambda: {"e0": Engine.from_pretrained(tiny_model_dir, num_blocks=128, progress=False)}
    )
    try:
        want = paper_example(local)
    finally:
        local.close()
    serve = Serve(tiny_model_dir, tmp_path, None)
    url = serve.start()
    backend = HttpBackend(url)
    try:
        assert paper_example(backend) == want
        with pytest.raises(ServerError, match="HTTP 404"):
            run_sync(backend, backend.get("no-such-run", "x", "latency"))
        # an awaited call starts as latency work: the wait is declared with the submission
        # it triggers (created, then added), not only when the GET reaches the server
        session = Session(backend)
        with session:
            code = write_code("a kite")
            test = write_test("a kite", code)
            test.get(perf="latency")
            write_code("a boat").get(perf="latency")
            bulk = write_code("a cart")
            bulk.get(perf="throughput")
            run_sync(backend, session.close())
        raw = httpx.get(f"{url}/v1/runs/{session.run_id}/events", timeout=60).text
        started = [e["data"] for e in sse_events(raw) if e["event"] == "call_started"]
        assert [c["objective"] for c in started] == ["latency"] * 3 + ["throughput"]
    finally:
        backend.close()
        serve.stop()
