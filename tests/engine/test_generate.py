"""End-to-end generation through the engine: batching, forks, preemption, chunking."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

from .helpers import complete

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(engine, n=4):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 32, 45, 8, 21][:n]
    return [torch.randint(3, engine.vocab_size, (k,), generator=g).tolist() for k in lengths]


def _hf_greedy(model_dir, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=n,
    )
    return out[0, len(prompt) :].tolist()


async def _batch(engine, prompts, sampling, prefix=""):
    async with engine:
        return await asyncio.gather(
            *(complete(engine, f"{prefix}{i}", p, sampling) for i, p in enumerate(prompts))
        )


def test_batched_greedy_equals_transformers_generate(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    prompts = _prompts(engine)
    ours = asyncio.run(_batch(engine, prompts, GREEDY))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == _hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    assert engine.stats_now().steps < sum(len(p) + GREEDY.max_tokens for p in prompts)


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_transformers(smollm2_dir):
    engine = Engine.from_pretrained(smollm2_dir, num_blocks=64, progress=False)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Parrots are birds that"]
    prompts = [engine.tokenize(t) for t in texts]
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    ours = asyncio.run(_batch(engine, prompts, sampling))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == _hf_greedy(smollm2_dir, prompt, 10)


def test_fork_generates_what_the_full_prompt_generates_and_shares_blocks(tiny_model_dir):
    bs = 16
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False
    )
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, engine.vocab_size, (40,), generator=g).tolist()
    suffixes = [torch.randint(3, engine.vocab_size, (k,), generator=g).tolist() for k in (5, 9, 1)]

    async def forked():
        async with engine:
            await engine.fill("parent", None, prefix)
            used_parent = engine.stats_now().blocks_used
            outs = await asyncio.gather(
                *(
                    complete(engine, f"c{i}", s, GREEDY, parent="parent")
                    for i, s in enumerate(suffixes)
                )
            )
            used = engine.stats_now().blocks_used
            return outs, used_parent, used

    outs, used_parent, used = asyncio.run(forked())
    plain = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False
    )
    expected = asyncio.run(_batch(plain, [prefix + s for s in suffixes], GREEDY))
    assert outs == expected
    assert used_parent == -(-len(prefix) // bs)
    # each child holds the parent's 2 full blocks by reference: only its own tail is new
    # (a copy of the shared partial block plus what it appended), never another prefix copy
    unshared = sum(-(-(len(prefix) + len(s) + GREEDY.max_tokens) // bs) for s in suffixes)
    children_own = used - used_parent
    assert children_own <= sum(
        -(-(len(prefix) % bs + len(s) + GREEDY.max_tokens) // bs) for s in suffixes
    )
    assert used < unshared


def test_preemption_under_a_tiny_pool_matches_an_ample_pool(tiny_model_dir):
    ample = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    prompts = _prompts(ample, 6)
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = asyncio.run(_batch(ample, prompts, sampling))
    tiny = Engine.from_pretrained(tiny_model_dir, num_blocks=8, progress=False)
    got = asyncio.run(_batch(tiny, prompts, sampling))
    assert got == expected
    assert tiny.stats_now().preemptions > 0


def test_chunked_prefill_matches_unchunked(tiny_model_dir):
    whole = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    prompts = _prompts(whole)
    expected = asyncio.run(_batch(whole, prompts, GREEDY))
    chunked = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, max_batched_tokens=7
    )
    assert asyncio.run(_batch(chunked, prompts, GREEDY)) == expected
    assert chunked.stats_now().steps > whole.stats_now().steps


def test_prefix_cache_reuses_blocks_and_can_be_switched_off(tiny_model_dir):
    prompt = torch.randint(3, 49152, (50,), generator=torch.Generator().manual_seed(5)).tolist()

    async def twice(engine):
        async with engine:
            first = await complete(engine, "a", prompt, GREEDY)
            await engine.free("a")
            second = await complete(engine, "b", prompt, GREEDY)
            return first, second, engine.stats_now()

    on = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    a, b, stats_on = asyncio.run(twice(on))
    assert a == b
    assert stats_on.prefix_cache_hits == 48  # three full blocks of the 50-token prompt
    off = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False)
    c, d, stats_off = asyncio.run(twice(off))
    assert (c, d) == (a, b)
    assert stats_off.prefix_cache_hits == 0
    assert stats_on.tokens_computed < stats_off.tokens_computed


def test_prefix_cache_is_salted(tiny_model_dir):
    prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(6)).tolist()

    async def go():
        engine = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
        async with engine:
            await engine.fill("t1", None, prompt, salt="tenant-1")
            await engine.fill("t2", None, prompt, salt="tenant-2")
            other = engine.stats_now().prefix_cache_hits
            await engine.fill("t1b", None, prompt, salt="tenant-1")
            return other, engine.stats_now().prefix_cache_hits

    other, same = asyncio.run(go())
    assert other == 0
    assert same == 32
