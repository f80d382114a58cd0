"""Parrot's manager driving a real llama.cpp server through the upstream adapter (greedy).

The oracle: every call's prompt rendered as a request-level client would (the template
with its input values substituted, tokenized as one text by llama.cpp's /tokenize) and sent
alone to llama.cpp's /completion with `cache_prompt: false`, one at a time in dependency
order. The manager's path sends the same token ids, concurrently where the program allows,
with llama.cpp's prompt cache on and the shared prefix warmed first. On this CPU build the
two agree token for token: llama.cpp's batched and cached evaluation did not flip a greedy
choice on these prompts (its docs warn that it may on some backends).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from parrot_backend.engine.engine import Engine
from parrot_backend.engines.upstream import UpstreamEngine, connect_all
from parrot_backend.manager.manager import Manager
from parrot_backend.program import RunSpec
from parrot_backend.testing.llama_server import LlamaServer, smollm2_gguf

from .programs import chain, managed, map_reduce, reference

pytestmark = pytest.mark.slow


def llama_reference(url: str, run: RunSpec) -> dict[str, str]:
    """The oracle on llama.cpp: /tokenize, then /completion alone, no prompt cache."""
    with httpx.Client(base_url=url, timeout=300) as client:

        def tokenize(text: str) -> list[int]:
            return client.post("/tokenize", json={"content": text}).json()["tokens"]

        def complete(ids: list[int], config) -> str:
            return client.post(
                "/completion",
                json={
                    "prompt": ids,
                    "n_predict": config.max_tokens,
                    "temperature": 0,
                    "stop": list(config.stop),
                    "cache_prompt": False,
                },
            ).json()["content"]

        return reference(run, tokenize, complete)


async def test_map_reduce_on_llama_cpp_equals_each_call_sent_alone(llama_server) -> None:
    job = map_reduce(4)
    want = llama_reference(llama_server.url, job)
    engine = await UpstreamEngine.connect(llama_server.url + "/v1")
    async with engine:
        [got], manager = await managed({"llama": engine}, job)
        assert got == want
        assert all(want[f"s{i}"].strip() for i in range(4))
        # one prefix context per static text (the maps' and the reduce's, both starting
        # with the system prompt), each warmed once on llama.cpp when first forked: the
        # maps' before the four fanned out
        assert manager.sharing.forks["llama"] == 5
        assert engine.warmups == 2
        assert len(engine.tree) == len(manager.sharing.table)  # the calls' contexts freed
    assert engine.stats_now().prefix_cache_hits > 0


async def test_chain_on_llama_cpp_equals_each_call_sent_alone(llama_server) -> None:
    job = chain()
    want = llama_reference(llama_server.url, job)
    engine = await UpstreamEngine.connect(llama_server.url + "/v1")
    async with engine:
        [got], manager = await managed({"llama": engine}, job)
    assert got == want
    events = [e.type for e in next(iter(manager.runs.values())).log.events]
    assert events.count("call_started") == 3


def kill_when_busy(victim: LlamaServer, engine_id: str):
    """An `on_started` hook: SIGKILL `victim` at the run's first token while a call runs on
    `engine_id` (the run has tokens to lose: its calls there are mid-generation)."""

    async def hook(manager: Manager) -> None:
        run = next(iter(manager.runs.values()))
        async for event in manager.subscribe(run.run_id):
            if event.type == "token" and any(
                s.engine == engine_id for s in run.calls.values() if s.state == "running"
            ):
                os.kill(victim.process.pid, signal.SIGKILL)
                return
        pytest.fail(f"no call ran on {engine_id}")

    return hook


def engines_used(manager: Manager) -> list[str]:
    run = next(iter(manager.runs.values()))
    return [e.payload["engine"] for e in run.log.events if e.type == "call_started"]


async def test_killing_llama_cpp_mid_run_fails_over_to_a_second_one(
    llama_server_bin, tmp_path
) -> None:
    """Two llama.cpp servers; the one running calls is killed (SIGKILL) once tokens flow:
    its calls run again on the other, and the run's values equal the oracle's.

    The policy places the maps (a task group sharing a prefix) together on the engine that
    ranks first when both are idle and hold nothing: ties go to the smaller engine id, so
    llama0 runs them and is the one killed."""
    job = map_reduce(6, max_tokens=24)
    servers = [
        LlamaServer(
            llama_server_bin,
            smollm2_gguf(),
            ctx_size=4 * 2048,
            parallel=4,
            threads=1,
            log_path=tmp_path / f"llama-{i}.log",
        )
        for i in range(2)
    ]
    with servers[0], servers[1]:
        want = llama_reference(servers[1].url, job)
        # one tokenizer for both (the manager renders with llama0's, which must survive it)
        connected = await connect_all([s.url + "/v1" for s in servers])
        engines = {f"llama{i}": e for i, e in enumerate(connected)}
        try:
            [got], manager = await managed(
                engines, job, on_started=kill_when_busy(servers[0], "llama0")
            )
        finally:
            for e in engines.values():
                await e.aclose()
        assert servers[0].process.poll() is not None  # it really died
    assert "llama0" not in manager.engines  # taken out of service
    assert got == want
    used = engines_used(manager)
    assert "llama0" in used and "llama1" in used
    assert len(used) > len(job.build().calls)  # some calls ran twice


async def test_killing_llama_cpp_mid_run_fails_over_to_the_in_process_engine(
    llama_server_bin, smollm2_dir, tmp_path
) -> None:
    """llama.cpp beside the in-process engine (same model, the engine's tokenizer): killing
    llama.cpp while it runs the maps sends them to the in-process engine and the run
    finishes. (The two run different weights, Q4_1 vs float32, so no value comparison.)"""
    job = map_reduce(4, max_tokens=12)
    local = Engine.from_pretrained(smollm2_dir, num_blocks=256, progress=False)
    server = LlamaServer(
        llama_server_bin,
        smollm2_gguf(),
        ctx_size=4 * 2048,
        parallel=4,
        threads=1,
        log_path=tmp_path / "llama.log",
    )
    with server:
        upstream = await UpstreamEngine.connect(
            server.url + "/v1", tokenizer=local.tokenizer, model_name=local.model_name
        )
        # "llama" ranks before "local" when both are idle: the maps start on llama.cpp
        async with local:
            try:
                [got], manager = await managed(
                    {"llama": upstream, "local": local},
                    job,
                    on_started=kill_when_busy(server, "llama"),
                )
            finally:
                await upstream.aclose()
        assert server.process.poll() is not None
    assert "llama" not in manager.engines
    used = engines_used(manager)
    assert "llama" in used and "local" in used
    assert set(got) == {*job.inputs, *(f"s{i}" for i in range(4)), "total"}
