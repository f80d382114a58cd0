"""The prompt's log probabilities (`fill(..., prompt_logprobs=k)`): the fill that computes
the tokens also scores them: per appended token its logprob given the tokens before and the
top-k there, equal to transformers' log-softmax of the logits at the position before.
Checked for a prompt over several prefill chunks, with the prefix cache holding the prompt
already (nothing taken from it: the answer is complete, the prompt computed once), beside
a row that did not ask, for a fill on a fork (its own tokens only), for generations after
it that reuse its KV (n choices), and for a fill preempted half-way."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parrot_backend.contract.engine import ScoredFill, TokenDelta
from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams, check_logprobs
from parrot_backend.contract.wire import FillRequest, FillResponse
from parrot_backend.engine import runner as runner_module
from parrot_backend.engine.engine import Engine

ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """transformers' log-softmax at every position of `ids`."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def _prompt(vocab: int, n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _check_prompt(entries, prompt: list[int], k: int, reference, before: list[int] = ()) -> None:
    """Every prompt token's entry against transformers (the first is None); `before`: the
    context's tokens before the fill's."""
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    every = [*before, *prompt]
    ref = reference(every)
    for i in range(1, len(prompt)):
        lp, top = entries[i]
        row = ref[len(before) + i - 1]
        assert lp == pytest.approx(float(row[prompt[i]]), abs=ATOL), i
        assert len(top) == k
        if k:
            want = torch.topk(row, k)
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=ATOL)
            for t, v in top:
                assert v == pytest.approx(float(row[t]), abs=ATOL)


def _engine(tiny_model_dir, **kw) -> Engine:
    kw = {"num_blocks": 96, "progress": False, "max_batched_tokens": 16, **kw}
    return Engine.from_pretrained(tiny_model_dir, **kw)


async def _generate(engine, cid, parent, sampling) -> list[TokenDelta]:
    return [d async for d in engine.generate(cid, parent, sampling)]


def _prefill(engine) -> int:
    return engine.stats_now().prefill_tokens_computed


def test_a_scoring_fill_over_chunks_with_the_prompt_cached_beside_a_row_not_asking(
    tiny_model_dir, reference, monkeypatch
):
    # small slices of positions too (the lm-head over a chunk goes in slices)
    monkeypatch.setattr(runner_module, "PROMPT_LOGITS_ROWS", 5)
    engine = _engine(tiny_model_dir)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 53)  # 4 chunks of 16, 3 full blocks + a partial
    other = _prompt(engine.vocab_size, 37, seed=4)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)

    async def main():
        async with engine:
            # an earlier request caches the prompt's blocks (and its greedy tokens)
            await engine.fill("warm", None, prompt)
            first = await _generate(engine, "warm", None, plain)
            await engine.free("warm")
            hits, prefill = engine.stats_now().prefix_cache_hits, _prefill(engine)

            async def scored_row():
                filled = await engine.fill("a", None, prompt, prompt_logprobs=3)
                return filled, await _generate(engine, "a", None, scored)

            async def plain_row():
                await engine.fill("b", None, other)
                return await _generate(engine, "b", None, plain)

            (filled, got), beside = await asyncio.gather(scored_row(), plain_row())
            after = engine.stats_now().prefix_cache_hits, _prefill(engine)
            # its blocks went into the prefix cache as usual
            await engine.fill("c", None, prompt)
            cached = engine.stats_now().prefix_cache_hits - after[0]
            return first, (hits, prefill), filled, got, beside, after, cached

    first, before, filled, got, beside, after, cached = asyncio.run(main())
    assert after[0] == before[0]  # the scoring fill took nothing from the cache ...
    assert after[1] - before[1] == len(prompt) + len(other)  # ... and computed it once
    assert cached == (len(prompt) // bs) * bs
    assert isinstance(filled, ScoredFill) and filled.length == len(prompt)
    _check_prompt(filled.prompt_logprobs, prompt, 3, reference)
    assert [d.token_id for d in got] == [d.token_id for d in first]
    # the generated tokens' own logprobs are those of plain decoding
    ref = reference(prompt + [d.token_id for d in got])
    for i, d in enumerate(got):
        assert d.logprob == pytest.approx(float(ref[len(prompt) - 1 + i, d.token_id]), abs=ATOL)
    assert all(d.logprob is None for d in beside)


def test_a_scoring_fill_alone_scores_the_prompt_and_generates_nothing(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir, prefix_cache=False)
    prompt = _prompt(engine.vocab_size, 21)

    async def main():
        async with engine:
            filled = await engine.fill("z", None, prompt, prompt_logprobs=0)
            tokens = engine.context_tokens("z")
            stats = engine.stats_now()
            await engine.free("z")
            return filled, tokens, stats

    filled, tokens, stats = asyncio.run(main())
    assert filled.length == len(prompt)
    _check_prompt(filled.prompt_logprobs, prompt, 0, reference)
    assert tokens == prompt and stats.tokens_generated == 0
    assert stats.prefill_tokens_computed == len(prompt)
    assert engine.contexts == {}


def test_a_fill_on_a_fork_scores_its_own_tokens_and_choices_reuse_its_kv(tiny_model_dir, reference):
    """A fill with a parent scores the tokens it appends only (the parent's KV is reused);
    n choices forked from a scored fill compute none of the prompt again."""
    engine = _engine(tiny_model_dir)
    prefix = _prompt(engine.vocab_size, 40, seed=8)
    question = _prompt(engine.vocab_size, 19, seed=9)

    async def main():
        async with engine:
            await engine.fill("p", None, prefix)
            before = _prefill(engine)
            filled = await engine.fill("q", "p", question, prompt_logprobs=2)
            fork_fill = _prefill(engine) - before
            samplings = [
                SamplingParams(max_tokens=3, ignore_eos=True),
                SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1),
            ]
            before = _prefill(engine)
            out = await asyncio.gather(
                *(_generate(engine, f"q/{i}", "q", s) for i, s in enumerate(samplings))
            )
            choices = _prefill(engine) - before
            for cid in ("q/0", "q/1", "q", "p"):
                await engine.free(cid)
            return filled, fork_fill, out, choices

    filled, fork_fill, out, choices = asyncio.run(main())
    assert filled.length == len(prefix) + len(question)
    _check_prompt(filled.prompt_logprobs, question, 2, reference, before=prefix)
    assert fork_fill == len(question)
    assert choices == 0 and [len(d) for d in out] == [3, 3]
    assert engine.pool.num_used == 0


def test_a_scoring_fill_preempted_half_way_is_complete(tiny_model_dir, reference):
    """A tiny pool: a generation that needs a block preempts the scoring fill (newer) in
    the middle of its prompt; the fill computes it again and its entries are all there."""
    engine = _engine(tiny_model_dir, num_blocks=7, prefix_cache=False, speculate=0)
    bs = engine.pool.block_size
    prompt = _prompt(engine.vocab_size, 6 * bs + 4, seed=11)
    short = _prompt(engine.vocab_size, bs - 6, seed=12)

    async def main():
        async with engine:
            await engine.fill("g", None, short)
            gen = asyncio.ensure_future(
                _generate(engine, "g", None, SamplingParams(max_tokens=2 * bs, ignore_eos=True))
            )
            await asyncio.sleep(0)
            filled = await engine.fill("s", None, prompt, prompt_logprobs=1)
            deltas = await gen
            stats = engine.stats_now()
            await engine.free("s")
            await engine.free("g")
            return filled, deltas, stats

    filled, deltas, stats = asyncio.run(main())
    assert stats.preemptions >= 1
    assert stats.prefill_tokens_computed > len(short) + len(prompt)  # some of it again
    assert len(deltas) == 2 * bs
    _check_prompt(filled.prompt_logprobs, prompt, 1, reference)


def test_rows_that_do_not_ask_do_no_prompt_work(tiny_model_dir, monkeypatch):
    def boom(*args):
        raise AssertionError("prompt logprobs computed for a row that did not ask")

    monkeypatch.setattr(runner_module.ModelRunner, "_score_prompt", boom)
    engine = _engine(tiny_model_dir)
    prompt = _prompt(engine.vocab_size, 30)

    async def main():
        async with engine:
            assert await engine.fill("n", None, prompt) == len(prompt)
            return await _generate(
                engine, "n", None, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
            )

    deltas = asyncio.run(main())
    assert len(deltas) == 3 and all(d.logprob is not None for d in deltas)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_prompt_logprobs_out_of_range_is_refused(tiny_model_dir, bad):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        check_logprobs("prompt_logprobs", bad, 49152)
    check_logprobs("prompt_logprobs", 20, 49152)
    engine = _engine(tiny_model_dir)

    async def main():
        async with engine:
            with pytest.raises(InvalidRequest, match="prompt_logprobs"):
                await engine.fill("x", None, [5, 6], prompt_logprobs=bad)
            assert engine.contexts == {}

    asyncio.run(main())


def test_max_tokens_zero_is_refused():
    """The prompt alone is a fill: a generation has at least one token."""
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0).validate(49152)


def test_scored_fills_cross_the_wire():
    """The fill's body takes `prompt_logprobs`; its answer has the entries only when asked."""
    assert FillRequest(context_id=1, token_ids=[1, 2], prompt_logprobs=2).prompt_logprobs == 2
    with pytest.raises(ValueError):
        FillRequest(context_id=1, token_ids=[1], prompt_logprobs="2")
    entries = [None, (-1.5, [(7, -0.5)]), (-2.0, [])]
    back = FillResponse.model_validate_json(
        FillResponse(length=3, prompt_logprobs=entries).model_dump_json()
    )
    assert back.prompt_logprobs == entries
    assert FillResponse(length=3).model_dump(exclude_none=True) == {"length": 3}
