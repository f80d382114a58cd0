"""The prompt's log probabilities (`SamplingParams.prompt_logprobs`): the first delta of a
generation carries, per prompt token, its logprob given the tokens before and the top-k
there, equal to transformers' log-softmax of the logits at the position before. Checked
for a prompt over several prefill chunks, with the prefix cache holding the prompt
already (nothing reused: the answer is complete), beside a row that did not ask, for
forks of a filled parent (n choices), with max_tokens 0, and over the wire."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from parrot_backend.contract.engine import TokenDelta
from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.contract.wire import delta_frame, delta_from_json, sse_events
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


def _check_prompt(entries, prompt: list[int], k: int, reference) -> None:
    """Every prompt token's entry against transformers (the first is None)."""
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    ref = reference(prompt)
    for i in range(1, len(prompt)):
        lp, top = entries[i]
        row = ref[i - 1]
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


def test_prompt_logprobs_over_chunks_with_the_prompt_cached_beside_a_row_not_asking(
    tiny_model_dir, reference, monkeypatch
):
    # small slices of positions too (the lm-head over a chunk goes in slices)
    monkeypatch.setattr(runner_module, "PROMPT_LOGITS_ROWS", 5)
    engine = _engine(tiny_model_dir)
    prompt = _prompt(engine.vocab_size, 53)  # 4 chunks of 16, 3 full blocks + a partial
    other = _prompt(engine.vocab_size, 37, seed=4)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2)

    async def main():
        async with engine:
            # an earlier request caches the prompt's blocks (and its greedy tokens)
            await engine.fill("warm", None, prompt)
            first = await _generate(engine, "warm", None, plain)
            await engine.free("warm")
            hits = engine.stats_now().prefix_cache_hits

            async def scored_row():
                await engine.fill("a", None, prompt)
                return await _generate(engine, "a", None, scored)

            async def plain_row():
                await engine.fill("b", None, other)
                return await _generate(engine, "b", None, plain)

            got, beside = await asyncio.gather(scored_row(), plain_row())
            return first, hits, got, beside, engine.stats_now()

    first, hits, got, beside, stats = asyncio.run(main())
    assert stats.prefix_cache_hits > hits  # the fill took the cached blocks
    _check_prompt(got[0].prompt_logprobs, prompt, 3, reference)
    assert all(d.prompt_logprobs is None for d in got[1:])
    assert [d.token_id for d in got] == [d.token_id for d in first]
    # the generated tokens' own logprobs are unchanged by it
    ref = reference(prompt + [d.token_id for d in got])
    for i, d in enumerate(got):
        assert d.logprob == pytest.approx(float(ref[len(prompt) - 1 + i, d.token_id]), abs=ATOL)
    assert all(d.prompt_logprobs is None and d.logprob is None for d in beside)


def test_max_tokens_zero_scores_the_prompt_and_ends(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir, prefix_cache=False)
    prompt = _prompt(engine.vocab_size, 21)

    async def main():
        async with engine:
            await engine.fill("z", None, prompt)
            deltas = await _generate(
                engine, "z", None, SamplingParams(max_tokens=0, prompt_logprobs=0)
            )
            tokens = engine.context_tokens("z")
            await engine.free("z")
            return deltas, tokens

    deltas, tokens = asyncio.run(main())
    assert len(deltas) == 1
    d = deltas[0]
    assert (d.token_id, d.text, d.finish_reason, d.logprob) == (None, "", "length", None)
    _check_prompt(d.prompt_logprobs, prompt, 0, reference)
    assert tokens == prompt  # nothing generated
    assert engine.contexts == {}


def test_forks_of_a_filled_parent_each_get_the_whole_prompt(tiny_model_dir, reference):
    """n choices: forks of the filled prompt, each asking (nothing of the parent's KV is
    reused for them), one of them with max_tokens 0."""
    engine = _engine(tiny_model_dir)
    prompt = _prompt(engine.vocab_size, 40, seed=8)

    async def main():
        async with engine:
            await engine.fill("p", None, prompt)
            samplings = [
                SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2),
                SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=1,
                               prompt_logprobs=2),
                SamplingParams(max_tokens=0, prompt_logprobs=2),
            ]  # fmt: skip
            out = await asyncio.gather(
                *(_generate(engine, f"p/{i}", "p", s) for i, s in enumerate(samplings))
            )
            for i in range(3):
                await engine.free(f"p/{i}")
            await engine.free("p")
            return out

    out = asyncio.run(main())
    for deltas in out:
        _check_prompt(deltas[0].prompt_logprobs, prompt, 2, reference)
    assert [len(d) for d in out] == [3, 3, 1]
    assert engine.pool.num_used == 0


def test_rows_that_do_not_ask_do_no_prompt_work(tiny_model_dir, monkeypatch):
    def boom(*args):
        raise AssertionError("prompt logprobs computed for a row that did not ask")

    monkeypatch.setattr(runner_module.ModelRunner, "_score_prompt", boom)
    engine = _engine(tiny_model_dir)
    prompt = _prompt(engine.vocab_size, 30)

    async def main():
        async with engine:
            await engine.fill("n", None, prompt)
            return await _generate(
                engine, "n", None, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
            )

    deltas = asyncio.run(main())
    assert len(deltas) == 3 and all(d.prompt_logprobs is None for d in deltas)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad).validate(49152)
    SamplingParams(prompt_logprobs=20).validate(49152)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0).validate(49152)
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate(49152)


def test_prompt_logprobs_cross_the_wire():
    async def parse(frames: list[bytes]) -> list[TokenDelta]:
        async def chunks():
            for f in frames:
                yield f

        return [delta_from_json(json.loads(data)) async for _, data in sse_events(chunks())]

    deltas = [
        TokenDelta(5, "a", None, -0.25, [(5, -0.25)], [None, (-1.5, [(7, -0.5)]), (-2.0, [])]),
        TokenDelta(None, "", "length", prompt_logprobs=[None]),
        TokenDelta(2, "", "stop"),
    ]
    back = asyncio.run(parse([delta_frame(d) for d in deltas]))
    assert back == deltas
    assert b"prompt_logprobs" not in delta_frame(deltas[2])
