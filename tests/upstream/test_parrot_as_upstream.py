"""The upstream adapter against parrot-backend's own OpenAI-compatible server (two processes).

Our server streams text only (no token ids), has no /tokenize, and takes prompts as token
ids: the adapter is given the model's tokenizer and re-tokenizes generated text into its
contexts. The oracle is the same server's /v1/completions, each call alone (greedy), so the
tiny random model's answers must come out the same through the manager.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server.serve_process import Serve

from parrot_backend.engines.upstream import UpstreamEngine

from .programs import chain, managed, map_reduce, reference


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    process = Serve(tiny_model_dir, tmp_path_factory.mktemp("serve-upstream"), None)
    process.start()
    yield process
    process.stop()


def completions_reference(url: str, run, tokenizer):
    with httpx.Client(base_url=url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def complete(ids: list[int], config) -> str:
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": config.max_tokens,
                "temperature": 0,
                "stop": list(config.stop) or None,
            }
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        return reference(
            run, lambda text: tokenizer.encode(text, add_special_tokens=False), complete
        )


async def test_programs_through_our_server_equal_each_call_sent_alone(
    serve, tiny_model_dir
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = await UpstreamEngine.connect(serve.url + "/v1", tokenizer=tokenizer)
    async with engine:
        assert engine.kind == "parrot" and engine.max_model_len == 512
        assert engine.chat_template == tokenizer.chat_template  # from the local tokenizer
        jobs = [map_reduce(3, max_tokens=6), chain(max_tokens=6)]
        want = [completions_reference(serve.url, job, tokenizer) for job in jobs]
        got, manager = await managed({"ours": engine}, *jobs)
        assert got == want
        stats = await engine.stats()
        assert stats.extra["kind"] == "parrot"
        # its /metrics were read (parrot_* gauges) and its contexts all freed but prefixes
        assert stats.extra["upstream"]["kv_usage"] is not None
        assert len(engine.tree) == len(manager.sharing.table)
        assert engine.warmups >= 1


async def test_closing_a_stream_cancels_the_request_on_our_server(serve, tiny_model_dir) -> None:
    from parrot_backend.contract.sampling import SamplingParams

    engine = await UpstreamEngine.connect(serve.url + "/v1", tokenizer=str(tiny_model_dir))
    async with engine:
        await engine.fill("c", None, engine.tokenize("Once upon a time"))
        stream = engine.generate("c", None, SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()

        def running() -> float:
            text = httpx.get(serve.url + "/metrics").text
            line = next(x for x in text.splitlines() if x.startswith("parrot_requests_running"))
            return float(line.rsplit(" ", 1)[1])

        # the server sees the disconnect and frees its request (a bound, not a timing check:
        # 400 tokens would keep it running far longer on this model)
        deadline = time.monotonic() + 120
        while running() != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert running() == 0
