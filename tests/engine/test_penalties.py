"""Presence and frequency penalties (OpenAI's definition): the engine's batched generation
equals a step-by-step transformers reference that applies the same formula, and a sampler
without penalties is the plain sampler."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.sampler import Sampler
from parrot_backend.program.generation import GenerationConfig

from .helpers import complete


def _reference(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with transformers, penalising each token by what this generation
    produced so far: logit -= frequency * count + presence * (count > 0)."""
    ids = torch.tensor([prompt])
    counts = torch.zeros(model.config.vocab_size)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1].float()
            logits = logits - counts * frequency - (counts > 0).float() * presence
            token = int(torch.argmax(logits))
            out.append(token)
            counts[token] += 1
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (5, 19, 33)]


# (presence, frequency). The random model's greedy text repeats no token in 16, so only
# negative penalties (which reward a repeat) change it; SmolLM2's below repeats itself.
PENALTIES = [(0.0, 1.5), (1.5, 0.0), (0.7, 0.9), (-1.0, 0.0), (0.0, -2.0)]


def test_penalised_greedy_equals_a_transformers_reference_in_one_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    prompts = _prompts(engine.vocab_size)
    n = 16
    jobs = [(p, pen) for p in prompts for pen in [*PENALTIES, (0.0, 0.0)]]

    async def go():
        async with engine:
            return await asyncio.gather(
                *(
                    complete(
                        engine,
                        f"r{i}",
                        p,
                        SamplingParams(
                            max_tokens=n,
                            ignore_eos=True,
                            presence_penalty=pp,
                            frequency_penalty=fp,
                        ),
                    )
                    for i, (p, (pp, fp)) in enumerate(jobs)
                )
            )

    ours = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    changed = 0
    by_prompt: dict[int, list[int]] = {}
    for (prompt, (pp, fp)), got in zip(jobs, ours, strict=True):
        assert got == _reference(model, prompt, n, pp, fp), (len(prompt), pp, fp)
        if (pp, fp) == (0.0, 0.0):
            by_prompt[len(prompt)] = got
    for (prompt, (pp, fp)), got in zip(jobs, ours, strict=True):
        changed += (pp, fp) != (0.0, 0.0) and got != by_prompt[len(prompt)]
    # each prompt's text changes under a negative penalty (a reward of 1-2 logits to repeat
    # beats the random model's top-2 gaps of 0.01-1.0)
    assert changed >= 3


@pytest.mark.slow
def test_smollm2_frequency_penalty_breaks_a_greedy_loop_as_the_reference_does(smollm2_dir):
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(smollm2_dir, num_blocks=64, progress=False)
    prompt = engine.tokenize("A cat is a cat. A cat is a cat. A cat is a cat. A cat")
    n = 20

    async def go():
        async with engine:
            return await asyncio.gather(
                complete(engine, "plain", prompt, SamplingParams(max_tokens=n, ignore_eos=True)),
                complete(
                    engine,
                    "pen",
                    prompt,
                    SamplingParams(max_tokens=n, ignore_eos=True, frequency_penalty=1.0),
                ),
            )

    plain, penalised = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    assert penalised == _reference(model, prompt, n, 0.0, 1.0)
    assert plain == _reference(model, prompt, n, 0.0, 0.0)
    # greedy loops on " is a cat. A cat"; the penalty makes it say something else
    assert len(set(penalised)) > len(set(plain))


def test_frequency_counts_every_repeat_and_presence_only_the_first():
    row = torch.zeros(8)
    row[3], row[5] = 10.0, 7.0  # token 3 first, then 5 once 3 is penalised below it

    def picks(params: SamplingParams, k: int) -> list[int]:
        s = Sampler(params)
        return [s(row.clone()) for _ in range(k)]

    # frequency 2: token 3 drops 2 per pick (10, 8, 6 < 7) then 5 and 3 alternate down
    assert picks(SamplingParams(frequency_penalty=2.0), 5) == [3, 3, 5, 3, 5]
    # presence 4: both drop once (10 -> 6, 7 -> 3) and stay there
    assert picks(SamplingParams(presence_penalty=4.0), 4) == [3, 5, 3, 3]
    # a negative penalty encourages repeats
    assert picks(SamplingParams(frequency_penalty=-1.0), 3) == [3, 3, 3]


def test_penalties_keep_the_grammar_mask():
    s = Sampler(SamplingParams(frequency_penalty=-2.0))
    s.grammar = object()  # only its presence matters to the sampler
    row = torch.arange(8, dtype=torch.float32)
    banned = torch.ones(8, dtype=torch.bool)
    banned[2] = False
    for _ in range(3):
        s.banned = [banned]
        assert s(row.clone()) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_sampler_without_penalties_keeps_no_counts(temperature):
    plain = Sampler(SamplingParams(temperature=temperature, seed=3))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        plain(torch.randn(512, generator=g))
    assert plain.counts is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", True),
    ],
)
def test_out_of_range_penalties_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value}).validate()


def test_a_program_output_carries_penalties_and_stores_no_new_keys_without_them():
    plain = GenerationConfig()
    assert "presence_penalty" not in plain.model_dump()
    assert "frequency_penalty" not in plain.model_dump()
    cfg = GenerationConfig(frequency_penalty=0.5, presence_penalty=-1.0)
    assert cfg.model_dump()["frequency_penalty"] == 0.5
    sampling = cfg.to_sampling()
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -1.0)
    assert GenerationConfig.model_validate(cfg.model_dump()) == cfg
    with pytest.raises(ValueError, match="frequency_penalty"):
        GenerationConfig(frequency_penalty=3.0)
