"""`logit_bias` reaches a real llama.cpp upstream (the llama-server this project builds):
a large bias forces its token, a ban moves the greedy decode off its first token, and
both equal what llama.cpp's own /completion gives with the same pairs."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engines.upstream import UpstreamEngine


async def _greedy(engine: UpstreamEngine, ids: list[int], bias=()) -> list[int]:
    await engine.fill("c", None, ids)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias=bias)
    try:
        return [d.token_id async for d in engine.generate("c", None, params) if d.token_id]
    finally:
        await engine.free("c")


@pytest.mark.slow
async def test_logit_bias_on_a_real_llama_server(llama_server) -> None:
    engine = await UpstreamEngine.connect(llama_server.url + "/v1")
    async with engine:
        async with httpx.AsyncClient(base_url=llama_server.url, timeout=120) as client:
            tokenized = await client.post("/tokenize", json={"content": "Parrots are birds that"})
            ids = tokenized.json()["tokens"]
            plain = await _greedy(engine, ids)
            forced = await _greedy(engine, ids, ((42, 100.0),))
            banned = await _greedy(engine, ids, ((plain[0], -100.0),))
            body = {"prompt": ids, "n_predict": 4, "temperature": 0, "cache_prompt": False}
            direct = await client.post(
                "/completion",
                json=body | {"logit_bias": [[plain[0], -100.0]], "return_tokens": True},
            )
    assert forced == [42] * 4
    assert banned[0] != plain[0]
    assert banned == direct.json()["tokens"]
