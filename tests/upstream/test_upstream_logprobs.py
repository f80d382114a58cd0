"""Log probabilities through upstream engines: llama.cpp's `completion_probabilities`
(token ids and raw-logit logprobs) pass through; the OpenAI-compatible kinds, which key
alternatives by text, are refused with a 400 naming the upstream."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engines.upstream import UpstreamEngine
from parrot_backend.server import ServerSettings, create_app

from .fake_upstream import EOS, CharTokenizer, FakeUpstream


class ScoringUpstream(FakeUpstream):
    """llama.cpp that answers `n_probs` as recent versions do: per token its id, logprob
    and the `n_probs` most likely (here: the token itself, then the next characters)."""

    def _sse(self, events: list[dict], done: bool) -> httpx.Response:
        n = self.requests[-1][1].get("n_probs") if self.requests else None
        if n:
            for e in events:
                if e.get("tokens"):
                    t = e["tokens"][0]
                    top = [
                        {"id": t + i, "token": chr(t + i), "logprob": -0.5 * (i + 1)}
                        for i in range(n)
                    ]
                    e["completion_probabilities"] = [
                        {
                            "id": t,
                            "token": chr(t),
                            "logprob": -0.5,
                            "bytes": [t],
                            "top_logprobs": top,
                        }
                    ]
        return super()._sse(events, done)


async def connect(fake: FakeUpstream) -> UpstreamEngine:
    kw = {} if fake.kind == "llama.cpp" else {"tokenizer": CharTokenizer()}
    return await UpstreamEngine.connect(
        "http://up:1/v1", transport=fake.transport(), sync_transport=fake.sync_transport(), **kw
    )


async def _generate(engine: UpstreamEngine, **sampling) -> list:
    await engine.fill("c", None, [ord(c) for c in "hi"])
    try:
        return [d async for d in engine.generate("c", None, SamplingParams(**sampling))]
    finally:
        await engine.free("c")


async def test_llama_cpp_logprobs_pass_through_by_token_id() -> None:
    fake = ScoringUpstream()
    fake.script = lambda prompt, n: [ord("a"), ord("b"), ord(EOS)][:n]
    async with await connect(fake) as engine:
        assert engine.supports_logprobs
        deltas = await _generate(engine, max_tokens=5, logprobs=2)
        body = fake.requests[-1][1]
        assert body["n_probs"] == 2 and body["post_sampling_probs"] is False
        a, b = deltas[0], deltas[1]
        assert (a.token_id, a.logprob, a.top_logprobs) == (97, -0.5, [(97, -0.5), (98, -1.0)])
        assert (b.token_id, b.logprob, b.top_logprobs) == (98, -0.5, [(98, -0.5), (99, -1.0)])
        eos = [d for d in deltas if d.token_id == ord(EOS)]
        assert eos and all(d.logprob is None for d in eos)  # not part of the text
        # logprobs=0: llama.cpp is asked for one (0 means none there), none is listed
        deltas = await _generate(engine, max_tokens=2, logprobs=0, ignore_eos=True)
        assert fake.requests[-1][1]["n_probs"] == 1
        assert [(d.logprob, d.top_logprobs) for d in deltas if d.token_id] == [(-0.5, [])] * 2
        # not asked: nothing sent, nothing returned
        deltas = await _generate(engine, max_tokens=2, ignore_eos=True)
        assert "n_probs" not in fake.requests[-1][1]
        assert all(d.logprob is None for d in deltas)


async def test_a_llama_cpp_that_returns_no_logprobs_is_an_error_not_a_silent_none() -> None:
    fake = FakeUpstream()  # answers without completion_probabilities
    async with await connect(fake) as engine:
        with pytest.raises(InvalidRequest, match="log probabilities"):
            await _generate(engine, max_tokens=3, logprobs=1)


async def test_openai_compatible_upstreams_refuse_logprobs_naming_themselves() -> None:
    fake = FakeUpstream("vllm")
    async with await connect(fake) as engine:
        assert not engine.supports_logprobs
        with pytest.raises(
            InvalidRequest, match=f"upstream engine \\({engine.kind} at http://up:1"
        ):
            await _generate(engine, max_tokens=3, logprobs=1)
        app = create_app(engine, settings=ServerSettings())
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            r = await client.post(
                "/v1/completions",
                json={"model": engine.model_name, "prompt": "hi", "logprobs": 1},
            )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logprobs" and f"{engine.kind} at http://up:1" in error["message"]
        assert fake.requests == [] or all("logprobs" not in b for _, b in fake.requests)


@pytest.mark.slow
async def test_logprobs_from_a_real_llama_server(llama_server) -> None:
    """The llama.cpp this project builds answers `n_probs` in the shape the adapter reads:
    greedy, each token is its own top alternative, with its logprob, alternatives sorted;
    and they are what llama.cpp's own /completion reports for the same prompt."""
    engine = await UpstreamEngine.connect(llama_server.url + "/v1")
    async with engine:
        async with httpx.AsyncClient(base_url=llama_server.url, timeout=120) as client:
            tokenized = await client.post("/tokenize", json={"content": "Parrots are birds that"})
            ids = tokenized.json()["tokens"]
            await engine.fill("c", None, ids)
            params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
            try:
                deltas = [d async for d in engine.generate("c", None, params)]
            finally:
                await engine.free("c")
            body = {"prompt": ids, "n_predict": 4, "temperature": 0, "n_probs": 3}
            direct = (await client.post("/completion", json=body | {"cache_prompt": False})).json()
    scored = [d for d in deltas if d.token_id is not None]
    assert len(scored) == 4
    for d, theirs in zip(scored, direct["completion_probabilities"], strict=True):
        assert d.logprob is not None and d.logprob <= 0
        assert len(d.top_logprobs) == 3
        assert d.top_logprobs[0][0] == d.token_id and d.top_logprobs[0][1] == d.logprob
        values = [lp for _, lp in d.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert d.token_id == theirs["id"]
        assert d.logprob == pytest.approx(theirs["logprob"], abs=0.05)


@pytest.mark.parametrize("kind", ["llama.cpp", "vllm"])
async def test_upstreams_refuse_the_prompts_logprobs(kind) -> None:
    """echo with logprobs (the prompt's logprobs) is a 400 naming the upstream, also on
    llama.cpp, which returns the generated tokens' logprobs; echo alone still works."""
    fake = ScoringUpstream() if kind == "llama.cpp" else FakeUpstream(kind)
    async with await connect(fake) as engine:
        assert not engine.supports_prompt_logprobs
        with pytest.raises(InvalidRequest, match=f"prompt's log probabilities.*{engine.kind}"):
            await engine.fill("c", None, [ord(c) for c in "hi"], prompt_logprobs=1)
        assert "c" not in engine.tree.contexts  # refused before anything is made
        app = create_app(engine, settings=ServerSettings())
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            body = {"model": engine.model_name, "prompt": "hi", "echo": True, "max_tokens": 0}
            r = await client.post("/v1/completions", json={**body, "logprobs": 1})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] in ("echo", "logprobs")
            assert f"{engine.kind} at http://up:1" in error["message"]
            sent = len(fake.requests)
            r = await client.post("/v1/completions", json=body)  # the prompt alone
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "hi"
            assert len(fake.requests) == sent  # nothing asked of the upstream
