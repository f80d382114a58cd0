"""Log probabilities (`SamplingParams.logprobs`): each generated token's logprob and its
top alternatives are the log-softmax of the model's raw logits at its position (checked
against transformers), with and without drafts, sampled or greedy, constrained or not,
and only for the rows that asked."""

from __future__ import annotations

import asyncio

import pytest
import torch

from parrot_backend.contract.engine import TokenDelta
from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.contract.wire import delta_frame, delta_from_json, sse_events
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.sampler import Sampler
from parrot_backend.engine.speculate import Drafter

ATOL = 1e-4


class OracleDrafter(Drafter):
    """Proposes each generation's known tokens, every third draft's second token wrong."""

    known: list[list[int]] = []

    def propose(self, tokens, k):
        for seq in self.known:
            if seq[: len(tokens)] == list(tokens) and len(seq) > len(tokens):
                draft = seq[len(tokens) : len(tokens) + k]
                if len(tokens) % 3 == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 49152
                return draft
        return []


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr("parrot_backend.engine.engine.Drafter", OracleDrafter)
    OracleDrafter.known = []
    return OracleDrafter


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(prompt: list[int], generated: list[int]) -> torch.Tensor:
        """transformers' log-softmax at each generated token's position."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0]
        return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], -1)

    return logprobs


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (9 + 4 * k,), generator=g).tolist() for k in range(n)]


async def _run(engine: Engine, prompts, samplings, prefix="r") -> list[list[TokenDelta]]:
    async def one(i, prompt, sampling):
        cid = f"{prefix}{i}"
        await engine.fill(cid, None, prompt)
        return [d async for d in engine.generate(cid, None, sampling)]

    async with engine:
        return await asyncio.gather(
            *(one(i, p, s) for i, (p, s) in enumerate(zip(prompts, samplings, strict=True)))
        )


def _check(deltas: list[TokenDelta], prompt: list[int], k: int, reference) -> None:
    """Every token's logprob and top-k against transformers."""
    tokens = [d.token_id for d in deltas]
    ref = reference(prompt, tokens)
    for i, d in enumerate(deltas):
        assert d.logprob is not None and d.top_logprobs is not None, i
        assert d.logprob == pytest.approx(float(ref[i, d.token_id]), abs=ATOL)
        assert d.logprob <= 0.0
        assert len(d.top_logprobs) == k
        values = [lp for _, lp in d.top_logprobs]
        assert values == sorted(values, reverse=True)  # most likely first
        if k:
            want = torch.topk(ref[i], k).values.tolist()
            assert values == pytest.approx(want, abs=ATOL)
            for t, lp in d.top_logprobs:
                assert lp == pytest.approx(float(ref[i, t]), abs=ATOL)
            if d.logprob > values[-1] + ATOL:  # in the top k: listed with its own logprob
                assert d.token_id in [t for t, _ in d.top_logprobs]


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5),
    "sampled": SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=5, logprobs=3),
    "penalized_top0": SamplingParams(
        max_tokens=16, ignore_eos=True, temperature=1.3, top_k=50, seed=9,
        presence_penalty=1.0, logprobs=0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_are_transformers_log_softmax_without_drafts(tiny_model_dir, reference, name):
    sampling = SAMPLINGS[name]
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False, speculate=0)
    prompts = _prompts(engine.vocab_size, 2)
    out = asyncio.run(_run(engine, prompts, [sampling] * 2))
    for prompt, deltas in zip(prompts, out, strict=True):
        assert len(deltas) == 16
        _check(deltas, prompt, sampling.logprobs, reference)
    if sampling.greedy:  # the argmax is the top alternative
        assert all(d.top_logprobs[0][0] == d.token_id for ds in out for d in ds)


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_drafted_tokens_get_the_logprobs_of_their_checking_step(
    tiny_model_dir, reference, oracle, name
):
    """Kept drafts' logprobs come from the step that checked them: the same numbers as
    plain decoding's (and as transformers')."""
    sampling = SAMPLINGS[name]
    plain = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False, speculate=0)
    prompts = _prompts(plain.vocab_size, 2)
    want = asyncio.run(_run(plain, prompts, [sampling] * 2, "p"))
    oracle.known = [p + [d.token_id for d in w] for p, w in zip(prompts, want, strict=True)]
    drafting = Engine.from_pretrained(
        tiny_model_dir, num_blocks=96, progress=False, speculate=4, speculate_rows=8
    )
    got = asyncio.run(_run(drafting, prompts, [sampling] * 2, "d"))
    stats = drafting.stats_now()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens
    for prompt, w, g in zip(prompts, want, got, strict=True):
        assert [d.token_id for d in g] == [d.token_id for d in w]
        _check(g, prompt, sampling.logprobs, reference)
        for a, b in zip(w, g, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL)


def test_only_rows_that_ask_get_logprobs_and_a_constrained_row_gets_the_raw_ones(
    tiny_model_dir, reference
):
    """One batch: a row without logprobs, two with, one of them constrained (its logprobs
    are of the model's distribution, before the grammar mask)."""
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=256, progress=False)
    prompts = _prompts(engine.vocab_size, 3)
    choice = Constraint("choice", ("yes indeed", "no way", "maybe so"))
    samplings = [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=4),
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=12, constraint=choice, logprobs=2),
    ]
    out = asyncio.run(_run(engine, prompts, samplings))
    _check(out[0], prompts[0], 4, reference)
    assert all(d.logprob is None and d.top_logprobs is None for d in out[1])
    text = "".join(d.text for d in out[2])
    assert text in choice.spec
    # every token, the EOS that ended the constrained row (if it took one) included
    _check(out[2], prompts[2], 2, reference)


def test_the_stop_token_that_ends_a_generation_has_its_logprob(tiny_model_dir, reference):
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    prompt = _prompts(engine.vocab_size, 1)[0]
    free = asyncio.run(
        _run(engine, [prompt], [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)], "f")
    )[0]
    stop = free[3].token_id
    assert stop not in [d.token_id for d in free[:3]]
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop], logprobs=1)
    out = asyncio.run(_run(engine, [prompt], [sampling], "s"))[0]
    assert [d.token_id for d in out] == [d.token_id for d in free[:4]]
    assert out[-1].finish_reason == "stop"
    _check(out, prompt, 1, reference)  # the stop token's entry is the model's, as the rest
    _check(out[:3], prompt, 1, reference)


def test_no_logprob_work_for_rows_that_did_not_ask(tiny_model_dir, monkeypatch):
    def boom(*args):
        raise AssertionError("logprobs computed for a row that did not ask")

    monkeypatch.setattr("parrot_backend.engine.sampler.token_logprobs", boom)
    assert Sampler(SamplingParams()).logprobs is None
    assert Sampler(SamplingParams()).plain_greedy
    assert not Sampler(SamplingParams(logprobs=0)).plain_greedy
    engine = Engine.from_pretrained(tiny_model_dir, num_blocks=96, progress=False)
    prompts = _prompts(engine.vocab_size, 2)
    samplings = [
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1),
    ]
    out = asyncio.run(_run(engine, prompts, samplings))
    assert all(d.logprob is None for ds in out for d in ds)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequest, match="logprobs"):
        SamplingParams(logprobs=bad).validate(49152)
    SamplingParams(logprobs=20).validate(49152)
    SamplingParams(logprobs=0).validate(49152)


def test_logprobs_cross_the_wire():
    async def parse(frames: list[bytes]) -> list[TokenDelta]:
        async def chunks():
            for f in frames:
                yield f

        import json

        return [delta_from_json(json.loads(data)) async for _, data in sse_events(chunks())]

    deltas = [
        TokenDelta(5, "a", None, -0.25, [(5, -0.25), (7, -1.5)]),
        TokenDelta(8, "b", None, -3.0, []),
        TokenDelta(2, "", "stop"),
    ]
    back = asyncio.run(parse([delta_frame(d) for d in deltas]))
    assert back == deltas
    assert b"logprob" not in delta_frame(deltas[2])  # nothing added when off
