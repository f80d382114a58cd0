"""Sampling never produces NaN or infinity, whatever finite in-range values a request
carries: temperatures of 1e-300 or 5e-324 and a top-p of 1e-300 used to make
`torch.multinomial` raise on the compute thread, which killed the engine."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.sampler import Sampler

from .helpers import collect

TEMPERATURES = [5e-324, 1e-300, 1e-45, 1e-38, 1e-8, 1e-5, 1e-3, 0.7, 1.0, 2.0, 1e3, 1e30, 1.7e308]
TOP_PS = [5e-324, 1e-300, 1e-45, 1e-8, 0.3, 0.9, 1.0]
TOP_KS = [0, 1, 2, 50, 49151, 49152]


def _logits(seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(49152, generator=g) * 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_extreme_combination_gives_a_token_in_the_vocabulary(dtype):
    rng = random.Random(3)
    cases = [(t, p, k) for t in TEMPERATURES for p in TOP_PS for k in TOP_KS]
    for t, p, k in rng.sample(cases, 150) + [(1e-300, 1.0, 0), (1.0, 1e-300, 0)]:
        params = SamplingParams(temperature=t, top_p=p, top_k=k, seed=rng.randrange(2**32))
        params.validate(49152)
        logits = _logits(rng.randrange(1000), dtype)
        token = Sampler(params)(logits)
        assert 0 <= token < 49152, (t, p, k)


def test_tiny_temperatures_and_top_p_pick_the_most_likely_token():
    logits = _logits(1)
    best = int(torch.argmax(logits))
    for t in (5e-324, 1e-300, 1e-45, 1e-8):
        assert Sampler(SamplingParams(temperature=t, seed=1))(logits) == best
    for p in (5e-324, 1e-300, 1e-45):
        assert Sampler(SamplingParams(temperature=1.0, top_p=p, seed=1))(logits) == best


def test_a_huge_temperature_with_top_k_still_samples_inside_the_top_k():
    logits = _logits(2)
    top = set(torch.topk(logits, 5).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=1.7e308, top_k=5, seed=4))
    assert {sampler(logits) for _ in range(40)} <= top


def test_non_finite_logits_fall_back_to_greedy():
    logits = _logits(3)
    logits[10] = float("nan")
    logits[11] = float("inf")
    token = Sampler(SamplingParams(temperature=1.0, seed=0))(logits)
    assert 0 <= token < 49152


def test_the_engine_serves_extreme_sampling_values_and_keeps_serving(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    rng = random.Random(5)

    async def go():
        async with engine:
            outs = []
            for i in range(12):
                params = SamplingParams(
                    max_tokens=4,
                    ignore_eos=True,
                    temperature=rng.choice(TEMPERATURES),
                    top_p=rng.choice(TOP_PS),
                    top_k=rng.choice(TOP_KS),
                    seed=i,
                )
                await engine.fill(i, None, [5 + i, 6, 7, 8])
                outs.append(await collect(engine, i, None, params))
                await engine.free(i)
            return outs, engine.error

    outs, error = asyncio.run(go())
    assert error is None
    assert all(len(tokens) == 4 for tokens, _, _ in outs)
