"""RemoteEngine against a real engine process on loopback (`engine_main` serving the tiny
model): same greedy tokens as the in-process engine, errors mapped back to the engine's
classes, early close cancelling the remote generation, and auth on every engine route."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from parrot_backend.contract.engine import EngineClient, EngineStats
from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    OutOfMemory,
    RequestCancelled,
)
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.contract.wire import error_from_response
from parrot_backend.engine.engine import Engine
from parrot_backend.engines.remote import RemoteEngine
from parrot_backend.server.engine_api import create_engine_app
from parrot_backend.server.engine_main import add_engine_parser
from parrot_backend.server.engine_main import main as engine_main

ENGINE_KEY = "sk-engine-test"
NUM_BLOCKS = 256
STARTUP_S = 90  # generous for 2 shared cores; every wait below is bounded


class EngineProcess:
    """`python -m parrot_backend.server.engine_main` on 127.0.0.1 with a free port."""

    def __init__(self, model: Path, tmp: Path, *extra: str, env: dict | None = None) -> None:
        self.out = tmp / f"engine-{uuid.uuid4().hex[:6]}.out"
        self.err = self.out.with_suffix(".err")
        cmd = [
            sys.executable,
            "-m",
            "parrot_backend.server.engine_main",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-blocks",
            str(NUM_BLOCKS),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *extra,
        ]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                env={**os.environ, "PARROT_ENGINE_API_KEY": ENGINE_KEY, **(env or {})},
            )
        self.url: str | None = None

    def wait_url(self, timeout: float = STARTUP_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if line.startswith("PARROT_ENGINE_URL="):
                    self.url = line.split("=", 1)[1].strip()
                    return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"engine did not start (rc={self.proc.poll()}):\n{self.stderr()}")

    def stderr(self) -> str:
        return self.err.read_text()[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    proc = EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine"))
    try:
        yield proc.wait_url()
    finally:
        proc.kill(signal.SIGTERM)


@pytest.fixture
async def remote(engine_url) -> RemoteEngine:
    engine = await RemoteEngine.connect(engine_url, api_key=ENGINE_KEY)
    yield engine
    await engine.aclose()


@pytest.fixture
async def local(tiny_model_dir) -> Engine:
    engine = Engine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="float32", num_blocks=NUM_BLOCKS, progress=False
    )
    async with engine:
        yield engine


def _ids(prefix: str) -> tuple[str, ...]:
    tag = uuid.uuid4().hex[:8]  # the engine process is shared by the module's tests
    return tuple(f"{prefix}-{tag}-{i}" for i in range(4))


async def _tokens(engine: EngineClient, cid, parent, sampling: SamplingParams) -> list[int]:
    return [d.token_id async for d in engine.generate(cid, parent, sampling)]


async def _script(engine: EngineClient, ids: tuple[str, ...]) -> dict:
    """fill, fork by fill, fork by generate, continue, free: what the manager does."""
    root, child, gen_child, _ = ids
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = engine.tokenize("You are a parrot. Repeat after me: the quick brown fox")
    out: dict = {"fill": await engine.fill(root, None, prompt)}
    out["root"] = await _tokens(engine, root, None, greedy)
    out["fork_fill"] = await engine.fill(child, root, engine.tokenize(" and then"))
    out["child"] = await _tokens(engine, child, None, greedy)
    out["child_more"] = await _tokens(engine, child, None, SamplingParams(max_tokens=5))
    out["fork_gen"] = await _tokens(engine, gen_child, root, greedy)
    out["int_id"] = await engine.fill(7, None, [5, 6, 7])  # int ids travel as ints
    stats = await engine.stats()
    out["contexts_during"] = stats.contexts
    for cid in (child, gen_child, root, 7):
        await engine.free(cid)
    return out


async def test_remote_matches_in_process_engine(remote, local, tiny_model_dir):
    assert isinstance(remote, EngineClient)
    assert remote.model_name == local.model_name
    assert (remote.vocab_size, remote.max_model_len) == (local.vocab_size, local.max_model_len)
    assert remote.eos_ids == local.eos_ids and remote.chat_template == local.chat_template
    for text in [
        "Hello, world!",
        "  spaces\tand\nnewlines",
        "ünïcödé 🦜 漢字",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ]:
        assert remote.tokenize(text) == local.tokenize(text)
        ids = local.tokenize(text) + [local.tokenizer.eos_token_id]
        assert remote.detokenize(ids) == local.detokenize(ids)

    # a tokenizer loaded locally from the same model tokenizes the same
    same = await RemoteEngine.connect(remote.base_url, api_key=ENGINE_KEY, tokenizer=tiny_model_dir)
    assert same.tokenizer is not remote.tokenizer
    assert same.tokenize("Hello, world! 🦜") == remote.tokenize("Hello, world! 🦜")
    await same.aclose()

    before = await remote.stats()
    got = await _script(remote, _ids("same"))
    want = await _script(local, _ids("same"))
    assert got == want
    suffix = len(remote.tokenize(" and then"))
    assert len(got["root"]) == 12 and got["fork_fill"] == got["fill"] + 12 + suffix
    after = await remote.stats()
    assert isinstance(after, EngineStats)
    assert after.block_size == 16 and after.blocks_total == NUM_BLOCKS
    assert after.contexts == before.contexts  # everything freed
    assert after.tokens_generated - before.tokens_generated == 12 * 3 + 5
    assert after.running == after.waiting == 0


async def test_text_deltas_and_stop_strings_match(remote, local):
    sampling = SamplingParams(max_tokens=30, stop=["e"], ignore_eos=True)
    results = []
    for engine in (remote, local):
        cid = _ids("stop")[0]
        await engine.fill(cid, None, engine.tokenize("Tell me a story about"))
        deltas = [d async for d in engine.generate(cid, None, sampling)]
        results.append([(d.token_id, d.text, d.finish_reason) for d in deltas])
        await engine.free(cid)
    assert results[0] == results[1]
    assert results[0][-1][2] in ("stop", "length")


async def test_errors_map_to_engine_classes(remote):
    root, child, _, other = _ids("err")
    with pytest.raises(ContextNotFound, match="unknown context"):
        await remote.fill(child, "no-such-parent", [1, 2])
    with pytest.raises(ContextNotFound):
        await _tokens(remote, "never-filled", None, SamplingParams())
    with pytest.raises(ContextNotFound):
        await remote.free("never-filled")
    await remote.fill(root, None, remote.tokenize("a parent prompt"))
    for bad in (
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(max_tokens=0),
        SamplingParams(top_k=10**7),
        SamplingParams(stop_token_ids=[10**9]),
    ):
        with pytest.raises(InvalidRequest):
            await _tokens(remote, root, None, bad)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await remote.fill(other, None, [remote.vocab_size + 5])
    with pytest.raises(InvalidRequest, match="maximum"):
        await remote.fill(other, None, [1] * (remote.max_model_len + 1))
    with pytest.raises(InvalidRequest, match="int or a str"):
        await remote.fill(("tuple", 1), None, [1])
    await remote.fill(child, root, [3, 4])
    with pytest.raises(ContextBusy, match="child"):
        await remote.free(root)  # the parent still has a live child
    await remote.free(child)
    await remote.free(root)
    # the engine kept serving through all of it
    await remote.fill(root, None, [1, 2, 3])
    assert len(await _tokens(remote, root, None, SamplingParams(max_tokens=3))) == 3
    await remote.free(root)


def test_error_bodies_and_statuses_map_back():
    def body(name: str) -> dict:
        return {"error": {"type": name, "message": "m"}}

    cases = [
        (400, body("InvalidRequest"), InvalidRequest),
        (404, body("ContextNotFound"), ContextNotFound),
        (409, body("ContextBusy"), ContextBusy),
        (507, body("OutOfMemory"), OutOfMemory),
        (503, body("RequestCancelled"), RequestCancelled),
        (503, body("EngineError"), EngineUnavailable),
        (401, body("Unauthorized"), EngineUnavailable),
        (507, None, OutOfMemory),
        (404, "not json", ContextNotFound),
        (400, None, InvalidRequest),
        (502, None, EngineUnavailable),
        (418, None, EngineError),
    ]
    for status, payload, cls in cases:
        err = error_from_response(status, payload)
        assert type(err) is cls, (status, payload, err)
        assert isinstance(err, EngineError)


async def test_unreachable_engine_is_unavailable(remote, engine_url):
    with pytest.raises(EngineUnavailable, match="cannot reach"):
        await RemoteEngine.connect(_closed_port_url(), api_key=ENGINE_KEY)
    with pytest.raises(EngineUnavailable, match="API key"):
        await RemoteEngine.connect(engine_url, api_key="wrong")
    # a client aimed at a dead address fails every primitive with EngineUnavailable
    dead = RemoteEngine(
        _closed_port_url(), api_key=ENGINE_KEY, info=remote.info, tokenizer=remote.tokenizer
    )
    with pytest.raises(EngineUnavailable):
        await dead.fill("x", None, [1])
    with pytest.raises(EngineUnavailable):
        await _tokens(dead, "x", None, SamplingParams())
    with pytest.raises(EngineUnavailable):
        await dead.stats()
    await dead.aclose()
    with pytest.raises(EngineUnavailable, match="closed"):
        await dead.free("x")


def _closed_port_url() -> str:
    """A loopback URL whose port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _wait_idle(engine: RemoteEngine, timeout: float = 30) -> EngineStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {stats}")
        await asyncio.sleep(0.02)


async def test_closing_generate_early_cancels_remote_generation(remote):
    cid = _ids("cancel")[0]
    await remote.fill(cid, None, remote.tokenize("count forever:"))
    before = await remote.stats()
    limit = remote.max_model_len - 20
    stream = remote.generate(cid, None, SamplingParams(max_tokens=limit, ignore_eos=True))
    got = [await anext(stream), await anext(stream)]
    assert all(d.finish_reason is None for d in got)
    await stream.aclose()
    after = await _wait_idle(remote)
    assert after.tokens_generated - before.tokens_generated < limit
    # nothing is queued on the context any more: it can be continued and freed
    assert len(await _tokens(remote, cid, None, SamplingParams(max_tokens=2))) == 2
    await remote.free(cid)


async def test_cancelling_a_waiting_generate_task_cancels_it(remote):
    cid = _ids("cancel-task")[0]
    await remote.fill(cid, None, remote.tokenize("go on:"))
    before = await remote.stats()
    limit = remote.max_model_len - 20

    async def consume() -> None:
        async for _ in remote.generate(
            cid, None, SamplingParams(max_tokens=limit, ignore_eos=True)
        ):
            pass

    task = asyncio.create_task(consume())
    while (await remote.stats()).tokens_generated == before.tokens_generated:
        assert not task.done()
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await _wait_idle(remote)
    assert after.tokens_generated - before.tokens_generated < limit
    await remote.free(cid)


def _engine_routes(local: Engine) -> list[tuple[str, str]]:
    app = create_engine_app(local, api_key="unused")
    routes = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, route.path))
    return routes


async def test_every_engine_route_needs_the_key(engine_url, local):
    routes = _engine_routes(local)
    paths = {path for _, path in routes}
    assert {
        "/engine/fill",
        "/engine/generate",
        "/engine/free",
        "/engine/stats",
        "/engine/info",
        "/engine/tokenizer",
        "/openapi.json",
        "/docs",
    } <= paths
    routes.append(("GET", "/no/such/route"))
    body = {"context_id": "x", "token_ids": [1]}
    async with httpx.AsyncClient(base_url=engine_url, timeout=20, trust_env=False) as client:
        for method, path in routes:
            if path == "/healthz":
                continue
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Basic {ENGINE_KEY}"},
                {"Authorization": ENGINE_KEY},
                {"Authorization": f"Bearer {ENGINE_KEY}x"},
            ):
                r = await client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["type"] == "Unauthorized"
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ok = {"Authorization": f"bearer {ENGINE_KEY}"}  # the scheme is case-insensitive
        assert (await client.get("/engine/info", headers=ok)).status_code == 200
        assert (await client.get("/openapi.json", headers=ok)).status_code == 200
    with pytest.raises(ValueError, match="key"):
        create_engine_app(local, api_key="")
    with pytest.raises(ValueError, match="key"):
        create_engine_app(local, api_key="  ")


async def test_malformed_bodies_are_400_with_a_message(engine_url):
    headers = {"Authorization": f"Bearer {ENGINE_KEY}"}
    async with httpx.AsyncClient(
        base_url=engine_url, headers=headers, timeout=20, trust_env=False
    ) as client:
        cases = [
            ("/engine/fill", {"context_id": [1], "token_ids": [1]}, "context_id"),
            ("/engine/fill", {"context_id": "a", "token_ids": ["1"]}, "token_ids"),
            ("/engine/fill", {"context_id": True, "token_ids": [1]}, "context_id"),
            ("/engine/fill", {"context_id": "a"}, "token_ids"),
            ("/engine/fill", {"context_id": "a", "token_ids": [], "x": 1}, "x"),
            (
                "/engine/generate",
                {"context_id": "a", "sampling": {"max_tokens": "9"}},
                "max_tokens",
            ),
            ("/engine/generate", {"context_id": "a", "sampling": {"temp": 1}}, "temp"),
            ("/engine/free", {}, "context_id"),
        ]
        for path, payload, field in cases:
            r = await client.post(path, json=payload)
            assert r.status_code == 400, (path, payload, r.text)
            error = r.json()["error"]
            assert error["type"] == "InvalidRequest" and field in error["message"]
        r = await client.post(
            "/engine/fill", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400
        # "1" and 1 are different contexts
        assert (
            await client.post("/engine/fill", json={"context_id": 1, "token_ids": [1]})
        ).json() == {"length": 1}
        r = await client.post("/engine/free", json={"context_id": "1"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "ContextNotFound"
        assert (await client.post("/engine/free", json={"context_id": 1})).status_code == 200


def test_engine_subcommand_parser():
    parser = argparse.ArgumentParser(prog="parrot-backend")
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parser(sub)
    args = parser.parse_args(
        [
            "engine",
            "--model",
            "m",
            "--manager",
            "http://h:1",
            "--port",
            "0",
            "--api-key",
            "k",
            "--manager-key",
            "op",
        ]
    )
    assert (args.model, args.manager, args.port, args.api_key, args.manager_key) == (
        "m",
        "http://h:1",
        0,
        "k",
        "op",
    )
    assert args.func.__name__ == "run_engine"


def test_engine_process_refuses_to_run_open(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.delenv("PARROT_ENGINE_API_KEY", raising=False)
    monkeypatch.delenv("PARROT_MANAGER_KEY", raising=False)
    argv = ["--model", str(tiny_model_dir), "--port", "0"]
    assert engine_main(argv) == 2  # before loading anything
    assert "needs a key" in capsys.readouterr().err
    assert engine_main([*argv, "--api-key", "k", "--manager", "http://127.0.0.1:9"]) == 2
    assert "--manager-key" in capsys.readouterr().err


async def test_engine_process_exits_nonzero_when_its_engine_dies(tiny_model_dir, tmp_path):
    proc = EngineProcess(tiny_model_dir, tmp_path, env={"PARROT_FAULT_ENGINE_STEP": "3"})
    try:
        engine = await RemoteEngine.connect(proc.wait_url(), api_key=ENGINE_KEY)
        await engine.fill("a", None, [1, 2, 3])
        # the loop dies at its 4th step: mid-stream or before the first token, the caller
        # sees the engine as unavailable
        with pytest.raises(EngineUnavailable):
            async with asyncio.timeout(STARTUP_S):
                async for _ in engine.generate(
                    "a", None, SamplingParams(max_tokens=50, ignore_eos=True)
                ):
                    pass
        await engine.aclose()
        assert await asyncio.to_thread(proc.proc.wait, STARTUP_S) == 1
        assert "engine failed" in proc.stderr()
    finally:
        proc.kill()


async def test_sse_parser_splits_only_at_line_feeds():
    from parrot_backend.contract.wire import sse_events as _sse_events
    from parrot_backend.contract.wire import sse_frame as _frame

    text = "a\u2028b\x85c\u2029d\r\ne"
    frames = [
        _frame({"token_id": 1, "text": text, "finish_reason": None}),
        b": ping\n\n",
        b'data: {"token_id":2,"text":"\xe2\x80\xa8raw","finish_reason":"stop"}\r\n\r\n',
        _frame({"error": {"type": "ContextBusy", "message": "m"}}, "error"),
    ]
    assert frames[0].isascii()
    blob = b"".join(frames)

    async def chunks():  # split everywhere, even inside multi-byte characters
        for i in range(0, len(blob), 3):
            yield blob[i : i + 3]

    events = [(name, json.loads(data)) async for name, data in _sse_events(chunks())]
    assert events == [
        ("message", {"token_id": 1, "text": text, "finish_reason": None}),
        ("message", {"token_id": 2, "text": "\u2028raw", "finish_reason": "stop"}),
        ("error", {"error": {"type": "ContextBusy", "message": "m"}}),
    ]


async def test_closing_the_client_ends_streams_in_progress(engine_url):
    engine = await RemoteEngine.connect(engine_url, api_key=ENGINE_KEY)
    cid = _ids("close")[0]
    await engine.fill(cid, None, engine.tokenize("again and again"))
    stream = engine.generate(cid, None, SamplingParams(max_tokens=400, ignore_eos=True))
    await anext(stream)
    await engine.aclose()
    with pytest.raises(EngineUnavailable):
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
    with pytest.raises(EngineUnavailable, match="closed"):
        await engine.fill(cid, None, [1])
    other = await RemoteEngine.connect(engine_url, api_key=ENGINE_KEY)
    await _wait_idle(other)
    await other.free(cid)
    await other.aclose()


def _map_reduce_spec():
    from parrot_backend.program import RunSpec

    gen = {"max_tokens": 5}
    calls = [
        {
            "name": f"map{i}",
            "outputs": {f"s{i}": gen},
            "template": f"Summarize: {{{{input:chunk{i}}}}} Summary: {{{{output:s{i}}}}}",
        }
        for i in range(4)
    ]
    calls.append(
        {
            "name": "reduce",
            "outputs": {"total": gen},
            "template": "Summaries: {{input:s0}} | {{input:s1}} | {{input:s2}} | {{input:s3}} "
            "All: {{output:total}}",
        }
    )
    return RunSpec.model_validate(
        {
            "program": {"calls": calls},
            "inputs": {f"chunk{i}": f"text of part {i} about parrots" for i in range(4)},
            "outputs": {"total": "latency"},
        }
    )


async def _run_managed(engines: dict) -> dict[str, str]:
    from parrot_backend.manager.manager import Manager

    job = _map_reduce_spec()
    async with Manager(engines) as manager:
        rid = await manager.create_run(job)
        await manager.get(rid, "total")
        async for _ in manager.subscribe(rid):
            pass  # until the run ends
        status = manager.run_status(rid)
        assert status.state == "finished"
        return dict(status.values)


async def test_manager_runs_programs_on_remote_engines(remote, tiny_model_dir):
    """The manager drives a RemoteEngine exactly as an in-process one, alone or mixed."""

    def fresh() -> Engine:
        return Engine.from_pretrained(
            tiny_model_dir, device="cpu", dtype="float32", num_blocks=NUM_BLOCKS, progress=False
        )

    async with fresh() as local:
        want = await _run_managed({"local": local})
    before = await remote.stats()
    await remote.reset()  # what the registry does when an engine (re-)registers
    assert await _run_managed({"remote": remote}) == want
    # a stopped manager frees its prefix contexts: the engine outlives it, clean
    assert (await remote.stats()).contexts == 0
    async with fresh() as local:
        assert await _run_managed({"remote": remote, "local": local}) == want
    after = await remote.stats()
    assert after.tokens_generated > before.tokens_generated  # the remote engine did work
    assert after.running == after.waiting == 0
    await remote.reset()


async def test_reset_frees_idle_contexts_children_first(remote):
    root, child, grandchild, busy = _ids("reset")
    await remote.reset()
    await remote.fill(root, None, [1, 2, 3])
    await remote.fill(child, root, [4])
    await remote.fill(grandchild, child, [5])
    await remote.fill(busy, None, remote.tokenize("keep generating"))
    stream = remote.generate(busy, None, SamplingParams(max_tokens=400, ignore_eos=True))
    await anext(stream)  # `busy` has a request in flight: reset must leave it alone
    assert await remote.reset() == 3
    assert (await remote.stats()).contexts == 1
    await stream.aclose()
    await _wait_idle(remote)
    assert await remote.reset() == 1
    assert (await remote.stats()).contexts == 0
    with pytest.raises(ContextNotFound):
        await remote.free(root)


class StuckEngine:
    """An engine whose fill and first token never come: only a cancel ends them. Records
    what started and what was cancelled (from uvicorn's thread; read by the test)."""

    model_name, vocab_size, max_model_len, contexts = "stuck", 100, 64, {}
    pool = type("Pool", (), {"block_size": 16})()

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def _block(self, what: str) -> None:
        self.started.append(what)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(what)
            raise

    async def fill(self, context_id, parent_id, token_ids, *, salt=None, priority=0) -> int:
        await self._block(f"fill:{context_id}")
        return 0

    async def generate(self, context_id, parent_id, sampling, *, salt=None, priority=0):
        await self._block(f"generate:{context_id}")
        yield  # pragma: no cover - never reached

    async def stats(self):  # pragma: no cover - unused
        raise NotImplementedError


async def test_cancelled_calls_cancel_the_engine_request_before_any_answer(local):
    from .conftest import LiveServer

    stuck = StuckEngine(local.tokenizer)
    with LiveServer(create_engine_app(stuck, api_key=ENGINE_KEY)) as server:
        engine = await RemoteEngine.connect(server.url, api_key=ENGINE_KEY)
        try:
            for what, call in [
                ("fill:a", lambda: engine.fill("a", None, [1])),
                ("generate:b", lambda: _tokens(engine, "b", None, SamplingParams())),
            ]:
                task = asyncio.create_task(call())
                async with asyncio.timeout(30):
                    while what not in stuck.started:
                        await asyncio.sleep(0.01)
                task.cancel()  # the manager gave up on this call: the HTTP request goes
                with pytest.raises(asyncio.CancelledError):
                    await task
                async with asyncio.timeout(30):
                    while what not in stuck.cancelled:
                        await asyncio.sleep(0.01)
        finally:
            await engine.aclose()
    assert stuck.cancelled == ["fill:a", "generate:b"]


async def test_openai_api_serves_from_a_remote_engine(remote, local):
    """The request-level server runs unchanged on a RemoteEngine (model name, context
    length, chat template and tokenizer all come from the engine)."""
    from parrot_backend.server import ServerSettings, create_app

    replies, before = [], await remote.stats()
    for engine in (remote, local):
        app = create_app(engine, settings=ServerSettings(api_keys={"sk-t": "t"}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://test",
            timeout=60,
            headers={"Authorization": "Bearer sk-t"},
        ) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": engine.model_name,
                    "max_tokens": 8,
                    "temperature": 0,
                    "n": 2,
                    "messages": [{"role": "user", "content": "Say something"}],
                },
            )
            assert r.status_code == 200, r.text
            replies.append(
                [(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]
            )
    assert replies[0] == replies[1]
    assert (await remote.stats()).contexts == before.contexts  # the server freed its own
