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


def test_a_fork_of_an_unaligned_parent_reuses_cached_blocks(tiny_model_dir):
    """A fork whose parent ends mid-block (37 tokens, blocks of 16) takes cached full
    blocks from inside that block on: the second identical fork computes only its tail,
    and generates what the first one and an engine without the cache generate."""
    g = torch.Generator().manual_seed(8)
    parent = torch.randint(3, 49152, (37,), generator=g).tolist()
    suffix = torch.randint(3, 49152, (60,), generator=g).tolist()

    async def forks(engine):
        async with engine:
            await engine.fill("p", None, parent)
            first = await complete(engine, "a", suffix, GREEDY, parent="p")
            await engine.free("a")
            before = engine.stats_now()
            second = await complete(engine, "b", suffix, GREEDY, parent="p")
            after = engine.stats_now()
            return (
                first,
                second,
                after.prefix_cache_hits - before.prefix_cache_hits,
                (after.tokens_computed - before.tokens_computed),
            )

    on = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    first, second, hits, computed = asyncio.run(forks(on))
    # blocks 2..5 (tokens 32..95) of the 97-token context: from inside the parent's last
    # block to the last full one; only the tail (tokens 96-) and the decode are computed
    assert hits == 64
    assert computed == 1 + GREEDY.max_tokens - 1  # the tail token, then the decode steps
    assert first == second
    off = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False)
    plain_first, plain_second, plain_hits, plain_computed = asyncio.run(forks(off))
    assert (plain_first, plain_second) == (first, second) and plain_hits == 0
    assert plain_computed == len(suffix) + GREEDY.max_tokens - 1


def test_requests_admitted_together_find_the_blocks_computed_while_they_waited(tiny_model_dir):
    """Four requests with one 50-token prompt arrive together; a step computes 16 tokens,
    so the first prefills alone for three steps while the others wait in the running set.
    Each asks the prefix cache when it first gets room, and takes the first one's three
    full blocks (asked at admission, they found none). Outputs equal the uncached run."""
    prompt = torch.randint(3, 49152, (50,), generator=torch.Generator().manual_seed(9)).tolist()

    async def together(engine):
        async with engine:
            outs = await asyncio.gather(
                *(complete(engine, f"r{i}", prompt, GREEDY) for i in range(4))
            )
            return outs, engine.stats_now()

    def engine(cache: bool) -> Engine:
        return Engine.from_pretrained(
            tiny_model_dir, num_blocks=64, progress=False, max_batched_tokens=16, prefix_cache=cache
        )

    outs, on = asyncio.run(together(engine(True)))
    plain, off = asyncio.run(together(engine(False)))
    assert outs == plain and all(o == outs[0] for o in outs)
    assert on.prefix_cache_hits == 3 * 48
    assert off.tokens_computed - on.tokens_computed == 3 * 48


def test_a_request_waits_a_step_for_blocks_another_computes_in_it(tiny_model_dir):
    """Four requests with one 208-token prompt (13 blocks), 128-token steps: the first
    computes blocks 0-7, then blocks 8-12 with room left over. The others would start in
    that step and compute blocks 8-10 again; they start in the next one instead and take
    all 13 blocks from the cache (each recomputes its last token only, for its logits)."""
    prompt = torch.randint(3, 49152, (208,), generator=torch.Generator().manual_seed(10)).tolist()

    async def together(engine):
        async with engine:
            outs = await asyncio.gather(
                *(complete(engine, f"r{i}", prompt, GREEDY) for i in range(4))
            )
            return outs, engine.stats_now()

    def engine(cache: bool) -> Engine:
        return Engine.from_pretrained(
            tiny_model_dir,
            num_blocks=128,
            progress=False,
            max_batched_tokens=128,
            prefix_cache=cache,
        )

    outs, on = asyncio.run(together(engine(True)))
    plain, off = asyncio.run(together(engine(False)))
    assert outs == plain and all(o == outs[0] for o in outs)
    assert on.prefix_cache_hits == 3 * 208
    assert off.tokens_computed - on.tokens_computed == 3 * 207


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


def _kept_vs_recomputed(engine, prompt, sampling, parent_tokens=None):
    """Greedy tokens and tokens computed for one fill + generate, with the fill's kept last
    hidden state used (as served) and thrown away (the last prompt token recomputed)."""

    async def go():
        results = []
        async with engine:
            for keep in (True, False):
                cid = f"k{keep}"
                parent = None
                if parent_tokens is not None:
                    await engine.fill(f"p{keep}", None, parent_tokens)
                    parent = f"p{keep}"
                before = engine.tokens_computed
                if prompt:
                    await engine.fill(cid, parent, prompt)
                    parent = None
                if not keep:  # the filled context's (or, for a bare fork, its parent's)
                    engine.contexts[parent or cid].last_hidden = None
                deltas = [d async for d in engine.generate(cid, parent, sampling)]
                results.append(([d.token_id for d in deltas], engine.tokens_computed - before))
        return results

    return asyncio.run(go())


def test_generation_samples_its_first_token_from_the_fills_kept_state(tiny_model_dir):
    """A fill keeps its context's last hidden state, so the generation after it computes no
    token twice; its tokens equal the recomputing path's and transformers' greedy ones."""
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False
    )
    prompt = _prompts(engine, 3)[2]  # 32 tokens
    (kept, kept_n), (plain, plain_n) = _kept_vs_recomputed(engine, prompt, GREEDY)
    assert kept == plain == _hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    # prompt tokens, then every generated token but the last (its KV is never needed)
    assert kept_n == len(prompt) + GREEDY.max_tokens - 1
    assert plain_n == kept_n + 1  # the recomputed last prompt token


def test_a_bare_fork_inherits_the_kept_state_and_a_longer_context_does_not(tiny_model_dir):
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=64, progress=False, prefix_cache=False
    )
    parent = _prompts(engine, 2)[1]
    # generate straight on a fork of the filled parent: the fork's tokens are the parent's
    (kept, kept_n), (plain, plain_n) = _kept_vs_recomputed(engine, [], GREEDY, parent)
    assert kept == plain
    assert kept_n == GREEDY.max_tokens - 1 and plain_n == kept_n + 1

    async def longer():
        async with engine:
            await engine.fill("a", None, parent)
            # tokens generated after the fill: its kept state is for a shorter context
            first = [d.token_id async for d in engine.generate("a", None, GREEDY)]
            assert engine.contexts["a"].last_hidden[0] == len(parent)
            before = engine.tokens_computed
            again = [d.token_id async for d in engine.generate("a", None, GREEDY)]
            return first, again, engine.tokens_computed - before

    first, again, n = asyncio.run(longer())
    assert n == GREEDY.max_tokens  # the last generated token computed first, then 11 more
    whole = Engine.from_pretrained(tiny_model_dir, num_blocks=64, progress=False)
    assert again == asyncio.run(_batch(whole, [parent + first], GREEDY))[0]
