"""Completion tokens count every token the engine generated, the EOS that ended the
generation included: OpenAI usage (streaming or not) and a native call's count (run
detail, `call_finished`) agree. Real engine on the tiny model, whose EOS is made the
token it greedily emits after a few others."""

from __future__ import annotations

import json

import pytest

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

from .native_support import native_app, run_body, sse_events

PROMPT = "Parrots are birds that"


@pytest.fixture
async def eos_after_some_tokens(tiny_model_dir):
    """The engine, started, and k: its greedy generation from PROMPT is k - 1 tokens,
    then the EOS (the k-th token, the first not seen before, made its only EOS id)."""
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    await engine.start()
    try:
        await engine.fill("probe", None, engine.tokenize(PROMPT))
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        tokens = [d.token_id async for d in engine.generate("probe", None, greedy)]
        await engine.free("probe")
        k = next(i + 1 for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
        engine.eos_ids = frozenset({tokens[k - 1]})
        yield engine, k
    finally:
        await engine.stop()


async def test_openai_usage_and_run_detail_both_count_the_eos(eos_after_some_tokens, tmp_path):
    engine, k = eos_after_some_tokens
    request = {"model": engine.model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    call = {"name": "c", "template": PROMPT + "{{output:y}}"}
    call["outputs"] = {"y": {"max_tokens": 12, "temperature": 0}}
    async with native_app(tmp_path, engine=engine) as (c, _):
        r = await c.post("/v1/completions", json=request)
        assert r.status_code == 200, r.text
        whole = r.json()
        streamed = await c.post(
            "/v1/completions",
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        )
        frames = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(f) for f in frames if f != "[DONE]"]
        rid = (await c.post("/v1/runs", json=run_body(call))).json()["run_id"]
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
        detail = (await c.get(f"/v1/runs/{rid}")).json()
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == k
    assert chunks[-1]["usage"] == whole["usage"]
    [finished] = [e["data"] for e in events if e["event"] == "call_finished"]
    assert detail["variables"]["y"]["value"] == whole["choices"][0]["text"]
    assert finished["finish_reasons"] == {"y": "stop"}
    assert detail["calls"][0]["completion_tokens"] == finished["completion_tokens"] == k


async def test_call_finished_counts_each_outputs_completion_tokens(eos_after_some_tokens, tmp_path):
    """A call's completion tokens per output (what the web page shows per variable): the
    first output stops at its max_tokens (before the EOS); the two add up to the call's."""
    engine, _ = eos_after_some_tokens
    call = {"name": "c", "template": PROMPT + "{{output:y}} and then {{output:w}}"}
    call["outputs"] = {
        "y": {"max_tokens": 2, "temperature": 0},
        "w": {"max_tokens": 3, "temperature": 0},
    }
    async with native_app(tmp_path, engine=engine) as (c, _):
        rid = (await c.post("/v1/runs", json=run_body(call))).json()["run_id"]
        events = sse_events((await c.get(f"/v1/runs/{rid}/events")).text)
    [finished] = [e["data"] for e in events if e["event"] == "call_finished"]
    assert finished["finish_reasons"]["y"] == "length"
    assert finished["output_tokens"]["y"] == 2
    assert 1 <= finished["output_tokens"]["w"] <= 3
    assert sum(finished["output_tokens"].values()) == finished["completion_tokens"]
