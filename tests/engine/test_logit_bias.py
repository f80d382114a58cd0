"""`SamplingParams.logit_bias` (OpenAI's logit_bias): added to its tokens' logits before
the pick, greedy and sampled, with drafts or not; logprobs stay the model's raw ones.
Checked against transformers' greedy decode of the biased logits on the tiny model."""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict

import pytest
import torch

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.contract.wire import GenerateRequest
from parrot_backend.engine.engine import Engine
from parrot_backend.engines.upstream.dialects import request as upstream_request


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def greedy(prompt: list[int], n: int, bias: dict[int, float]) -> tuple[list[int], list]:
        """transformers' greedy tokens over the biased logits, and the raw log-softmax
        rows at their positions."""
        ids, rows = list(prompt), []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                rows.append(torch.log_softmax(logits, -1))
                biased = logits.clone()
                for t, b in bias.items():
                    biased[t] += b
                ids.append(int(biased.argmax()))
        return ids[len(prompt) :], rows

    return greedy


def _prompt(vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (11,), generator=g).tolist()


async def _generate(engine: Engine, prompt: list[int], sampling: SamplingParams, cid: str):
    await engine.fill(cid, None, prompt)
    out = [d async for d in engine.generate(cid, None, sampling)]
    await engine.free(cid)
    return out


def _run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]):
    async def go():
        async with engine:
            return await asyncio.gather(
                *(_generate(engine, p, s, f"c{i}") for i, (p, s) in enumerate(jobs))
            )

    return asyncio.run(go())


@pytest.mark.parametrize("speculate", [0, 4])
def test_greedy_follows_the_biased_logits(tiny_model_dir, reference, speculate):
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=96, progress=False, speculate=speculate
    )
    vocab = engine.vocab_size
    prompt, other = _prompt(vocab, 1), _prompt(vocab, 2)
    plain, _ = reference(prompt, 8, {})
    # ban the first greedy token and favour two others a little: a different decode
    bias = {plain[0]: -100.0, plain[1]: 2.5, 7: 1.5}
    want, rows = reference(prompt, 8, bias)
    assert want != plain
    forced = reference(other, 6, {42: 100.0})[0]
    assert forced == [42] * 6
    sampling = SamplingParams(
        max_tokens=8, ignore_eos=True, logit_bias=tuple(bias.items()), logprobs=1
    )
    biased, unbiased, all_42 = _run(
        engine,
        [
            (prompt, sampling),
            (prompt, SamplingParams(max_tokens=8, ignore_eos=True)),  # a plain row beside
            (other, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((42, 100.0),))),
        ],
    )
    assert [d.token_id for d in biased] == want
    assert [d.token_id for d in unbiased] == plain
    assert [d.token_id for d in all_42] == forced
    # logprobs are the model's, not the biased ones
    for d, row in zip(biased, rows, strict=True):
        assert d.logprob == pytest.approx(float(row[d.token_id]), abs=1e-4)


def test_a_sampled_row_cannot_escape_a_large_bias(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    prompt = _prompt(engine.vocab_size, 3)
    sampling = SamplingParams(
        max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logit_bias=((99, 100.0),)
    )
    free = SamplingParams(max_tokens=30, temperature=1.5, seed=6, ignore_eos=True)
    forced, picked = _run(engine, [(prompt, sampling), (prompt, free)])
    assert [d.token_id for d in forced] == [99] * 10
    # the same sampled generation with every token it picked banned picks none of them
    seen = sorted({d.token_id for d in picked})
    banned = SamplingParams(
        max_tokens=30,
        temperature=1.5,
        seed=6,
        ignore_eos=True,
        logit_bias=tuple((t, -100.0) for t in seen),
    )
    (again,) = _run(engine, [(prompt, banned)])
    assert len(again) == 30 and not {d.token_id for d in again} & set(seen)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((5, 101.0),), "in [-100, 100]"),
        (((5, math.nan),), "in [-100, 100]"),
        (((5, 1.0), (5, 2.0)), "twice"),
        (((-1, 1.0),), "outside the vocabulary"),
        (((10**9, 1.0),), "outside the vocabulary"),
        (((True, 1.0),), "outside the vocabulary"),
        (((5,),), "pairs"),
        (tuple((i, 1.0) for i in range(1025)), "at most 1024"),
    ],
)
def test_bad_bias_is_refused(bias, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias).validate(vocab_size=1000)


def test_the_engine_refuses_a_bad_bias_before_generating(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    prompt = _prompt(engine.vocab_size, 4)
    bad = SamplingParams(max_tokens=2, logit_bias=((engine.vocab_size, 1.0),))

    async def go():
        async with engine:
            await engine.fill("x", None, prompt)
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                async for _ in engine.generate("x", None, bad):
                    pass
            await engine.free("x")

    asyncio.run(go())


def test_the_bias_crosses_the_wire_and_reaches_upstreams_in_their_shapes():
    s = SamplingParams(max_tokens=3, logit_bias=((5, -100.0), (7, 2.5)))
    sent = {"context_id": "a", "parent_id": None, "sampling": asdict(s)}
    assert GenerateRequest.model_validate(sent).sampling == s
    _, llama = upstream_request("llama.cpp", "m", [1, 2], s, 3, None)
    assert llama["logit_bias"] == [[5, -100.0], [7, 2.5]]
    _, vllm = upstream_request("vllm", "m", [1, 2], s, 3, None)
    assert vllm["logit_bias"] == {"5": -100.0, "7": 2.5}
    _, plain = upstream_request("vllm", "m", [1, 2], SamplingParams(max_tokens=3), 3, None)
    assert "logit_bias" not in plain
