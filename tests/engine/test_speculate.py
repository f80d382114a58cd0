"""Prompt-lookup drafts (`engine/speculate.py`): an unconstrained generation checks tokens
guessed from its own context in one step, and yields exactly what plain decoding gives:
greedy, sampled with a seed, and penalized."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engine.config import EngineConfig, pick_speculate
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.speculate import Drafter, accept

from .helpers import collect, complete


# ----------------------------------------------------------------- the drafter alone
def test_drafter_takes_what_followed_the_latest_earlier_match():
    d = Drafter()
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 1, 2, 3]
    # the tail (1, 2, 3) occurred at 0 and at 5; the latest (5) was followed by 9, 8, 1
    assert d.propose(tokens, 3) == [9, 8, 1]
    assert d.propose(tokens, 1) == [9]
    assert d.propose(tokens, 0) == []
    # appended tokens are indexed on the next call: (2, 3, 7) is new, (3, 7) too, but 7
    # followed nothing yet and the unigram 7 has no earlier occurrence
    tokens += [7]
    assert d.propose(tokens, 2) == []
    tokens += [4]  # ... (3, 7, 4): no; (7, 4): no; 4 followed 3 at position 3: 5, 1
    assert d.propose(tokens, 2) == [5, 1]


def test_drafter_prefers_the_longest_match_and_stops_at_the_context_end():
    d = Drafter()
    # unigram 3 last occurred at 4 (followed by 6), but the bigram (2, 3) at 1-2 (then 4)
    tokens = [1, 2, 3, 4, 3, 6, 2, 3]
    assert d.propose(tokens, 2) == [4, 3]
    # a continuation shorter than k: what there is
    assert Drafter().propose([5, 6, 5], 4) == [6, 5]
    assert Drafter().propose([5], 4) == []
    # a context cut back (not done by the engine, but harmless): indexed again
    d2 = Drafter()
    d2.propose([1, 2, 1, 2, 1], 2)
    assert d2.propose([4, 5, 4], 2) == [5, 4]


def test_a_drafter_whose_drafts_are_not_kept_pauses_and_retries():
    from parrot_backend.engine import speculate

    d = Drafter()
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.propose(tokens, 2) == [3, 1]
    checks = 0
    while d.rate >= speculate.MIN_RATE:  # checks that keep nothing
        d.record(2, 0)
        checks += 1
    assert checks == 5  # 0.5 -> 0.35 -> 0.245 -> 0.17 -> 0.12 -> 0.08
    # paused: RETRY_AFTER proposals come back empty, then one is made
    skipped = [d.propose(tokens, 2) for _ in range(speculate.RETRY_AFTER)]
    assert skipped == [[]] * speculate.RETRY_AFTER
    assert d.propose(tokens, 2) == [3, 1]
    d.record(2, 2)  # that one was kept: drafting goes on
    assert d.rate >= speculate.MIN_RATE and d.propose(tokens, 2) == [3, 1]


def test_accept_keeps_the_matching_drafts_and_the_next_prediction():
    def picks(seq):
        return seq.__getitem__

    assert accept([5, 6, 7], picks([5, 6, 7, 8])) == [5, 6, 7, 8]  # all kept, plus the bonus
    assert accept([5, 6, 7], picks([5, 9, 7, 8])) == [5, 9]  # second draft wrong: model's 9
    assert accept([5, 6, 7], picks([4, 6, 7, 8])) == [4]  # the first wrong: one token
    assert accept([], picks([3])) == [3]


def test_accept_picks_in_order_and_only_while_drafts_are_kept():
    """A sampler is called once per token the row yields, in order: its random generator
    advances as in plain decoding."""
    asked = []

    def pick(i):
        asked.append(i)
        return [5, 9, 7, 8][i]

    assert accept([5, 6, 7], pick) == [5, 9]
    assert asked == [0, 1]  # position 2 follows a rejected draft: never sampled


def test_sampled_accept_keeps_a_draft_with_the_models_probability():
    """With a sampler, a draft token is kept as often as the model picks it, and a
    rejected position yields the model's distribution without the draft (speculative
    sampling with a one-token draft): the first token's distribution is p either way."""
    from parrot_backend.engine.sampler import Sampler

    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log().repeat(2, 1)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3, max_tokens=2))
    n = 4000
    firsts = [accept([1], lambda i: sampler(logits[i]))[0] for _ in range(n)]
    freq = torch.bincount(torch.tensor(firsts), minlength=3).float() / n
    # binomial standard deviations at n = 4000 are <= 0.008; 5 of them
    assert torch.allclose(freq, p, atol=0.04), freq


def test_pick_speculate_defaults_and_checks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_speculate(EngineConfig(), cpu) == (4, 2)
    assert pick_speculate(EngineConfig(), cuda)[0] == 0
    assert pick_speculate(EngineConfig(speculate=0), cpu)[0] == 0
    assert pick_speculate(EngineConfig(speculate=6, speculate_rows=1), cpu) == (6, 1)
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ValueError, match="speculate"):
            pick_speculate(EngineConfig(speculate=bad), cpu)


# ----------------------------------------------------------------- end to end
# The tiny random model does not copy from its context, so the real drafter rarely finds
# anything there. An oracle drafter knows each prompt's plain greedy tokens and proposes
# them with every third draft's second token wrong: rows keep all, some or none of their
# drafts, and later tokens read the KV that kept drafts wrote.


class OracleDrafter(Drafter):
    known: list[list[int]] = []  # prompt + plain greedy tokens, one list per generation

    def propose(self, tokens, k):
        for seq in self.known:
            if seq[: len(tokens)] == list(tokens) and len(seq) > len(tokens):
                draft = seq[len(tokens) : len(tokens) + k]
                if len(tokens) % 3 == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 49152  # a wrong guess
                return draft
        return []


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr("parrot_backend.engine.engine.Drafter", OracleDrafter)
    OracleDrafter.known = []
    return OracleDrafter


def _prompts(engine, n):
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, engine.vocab_size, (9 + 4 * k,), generator=g).tolist() for k in range(n)
    ]


def _engines(model_dir, **kw):
    plain = Engine.from_pretrained(model_dir, num_blocks=96, progress=False, speculate=0, **kw)
    drafting = Engine.from_pretrained(
        model_dir, num_blocks=96, progress=False, speculate=4, speculate_rows=8, **kw
    )
    return plain, drafting


async def _each(engine, prompts, sampling, prefix):
    async with engine:
        return await asyncio.gather(
            *(complete(engine, f"{prefix}{i}", p, sampling) for i, p in enumerate(prompts))
        )


def test_kept_drafts_give_plain_greedy_tokens_in_fewer_steps(tiny_model_dir, oracle):
    from transformers import AutoModelForCausalLM

    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 3)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    oracle.known = [p + w for p, w in zip(prompts, want, strict=True)]
    got = asyncio.run(_each(drafting, prompts, sampling, "d"))
    assert got == want
    s = drafting.stats_now()
    assert 0 < s.draft_tokens_accepted < s.draft_tokens  # some kept, some not
    assert s.steps < plain.stats_now().steps  # kept drafts: fewer steps for the same tokens
    assert s.tokens_generated == plain.stats_now().tokens_generated == 3 * 40
    # KV kept: every prompt and generated token's once, as without drafts (a kept draft's
    # KV is the KV of the token it turned out to be; the others count as drafts only)
    assert s.tokens_computed == plain.stats_now().tokens_computed
    assert plain.stats_now().draft_tokens == 0
    # and both are transformers' greedy tokens
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for prompt, tokens in zip(prompts, got, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert tokens == ref[0, len(prompt) :].tolist()


class WrongDrafter(Drafter):
    """Always proposes k tokens, (almost) never the right ones."""

    def propose(self, tokens, k):
        return [(tokens[-1] + 1 + i) % 49152 for i in range(k)]


@pytest.fixture
def always_drafts(monkeypatch):
    monkeypatch.setattr("parrot_backend.engine.engine.Drafter", WrongDrafter)


def test_wrong_drafts_only_cost_rows(tiny_model_dir, always_drafts):
    """A drafter that is always wrong: every decode step checks drafts, none is kept,
    and the tokens are still the plain ones."""
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    assert asyncio.run(_each(drafting, prompts, sampling, "d")) == want
    s = drafting.stats_now()
    assert s.draft_tokens > 0 and s.draft_tokens_accepted == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 17])
def test_drafts_never_run_past_max_tokens(tiny_model_dir, oracle, max_tokens):
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    # the oracle knows more than max_tokens: drafts past the limit would be kept
    longer = asyncio.run(
        _each(plain, prompts, SamplingParams(max_tokens=max_tokens + 8, ignore_eos=True), "q")
    )
    oracle.known = [p + w for p, w in zip(prompts, longer, strict=True)]
    got = asyncio.run(_each(drafting, prompts, sampling, "d"))
    assert got == want
    assert all(len(t) == max_tokens for t in got)


def test_stop_strings_and_stop_tokens_end_a_drafted_row_where_plain_decoding_ends(
    tiny_model_dir, oracle
):
    plain, drafting = _engines(tiny_model_dir)
    prompt = _prompts(plain, 1)[0]
    free = asyncio.run(_each(plain, [prompt], SamplingParams(max_tokens=40, ignore_eos=True), "f"))
    oracle.known = [prompt + free[0]]
    stop_text = plain.detokenize(free[0][12:14])
    assert stop_text.strip()  # a stop string that the text reaches mid-way

    async def gen(engine, sampling, tag):
        async with engine:
            await engine.fill(tag, None, prompt)
            tokens, text, deltas = await collect(engine, tag, None, sampling)
            # what the context holds after the generation is the same too
            return tokens, text, deltas[-1].finish_reason, engine.context_tokens(tag)

    for i, sampling in enumerate(
        (
            SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_text]),
            SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[free[0][9]]),
        )
    ):
        want = asyncio.run(gen(plain, sampling, f"p{i}"))
        assert asyncio.run(gen(drafting, sampling, f"d{i}")) == want
        assert len(want[0]) < 40  # it did stop early
    assert drafting.stats_now().draft_tokens_accepted > 0


def test_forks_draft_without_touching_their_parents_blocks(tiny_model_dir, oracle):
    """Forks of one unaligned prefix write their drafts' KV into their own copies of the
    shared partial block (copy-on-write): the parent generates what it would alone."""

    async def run(engine, prefix):
        sampling = SamplingParams(max_tokens=24, ignore_eos=True)
        async with engine:
            await engine.fill("root", None, prefix)
            forks = await asyncio.gather(
                *(collect(engine, f"f{i}", "root", sampling) for i in range(3))
            )
            parent = await collect(engine, "root", None, sampling)
            return [f[0] for f in forks], parent[0]

    plain, drafting = _engines(tiny_model_dir)
    prefix = _prompts(plain, 2)[1]  # 13 tokens: the shared block is partial
    want = asyncio.run(run(plain, prefix))
    oracle.known = [prefix + want[0][0]]  # every fork and then the parent: the same text
    assert asyncio.run(run(drafting, prefix)) == want
    assert drafting.stats_now().draft_tokens_accepted > 0


SCHEMA = {
    "type": "object",
    "properties": {
        "title_of_the_document": {"type": "string", "maxLength": 12},
        "number_of_pages_in_total": {"type": "integer", "minimum": 1, "maximum": 999},
    },
    "required": ["title_of_the_document", "number_of_pages_in_total"],
}
CONSTRAINED = {
    "json_greedy": SamplingParams(
        max_tokens=48, constraint=Constraint("json_schema", json.dumps(SCHEMA))
    ),
    "json_sampled": SamplingParams(
        max_tokens=48,
        temperature=0.9,
        seed=3,
        constraint=Constraint("json_schema", json.dumps(SCHEMA)),
    ),
    "regex_sampled": SamplingParams(
        max_tokens=24, temperature=0.8, seed=8, constraint=Constraint("regex", "[a-z ]{1,40}")
    ),
}


@pytest.mark.parametrize("name", list(CONSTRAINED))
def test_constrained_rows_draft_and_yield_the_plain_tokens(tiny_model_dir, oracle, name):
    """A constrained row drafts (the tokens its grammar forces, else the oracle's guess cut
    where the grammar stops allowing it), samples each position under that position's
    mask, and yields the tokens and text plain constrained decoding gives."""
    sampling = CONSTRAINED[name]
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    oracle.known = [p + w for p, w in zip(prompts, want, strict=True)]
    got = asyncio.run(_each(drafting, prompts, sampling, "d"))
    assert got == want
    s = drafting.stats_now()
    assert 0 < s.draft_tokens_accepted <= s.draft_tokens
    assert s.steps < plain.stats_now().steps
    # a generation that ends where its grammar stops ends on a token it does not compute
    # plainly; with drafts that token may have been a kept draft, whose KV the step did
    # compute (it is then counted): at most one more token per generation
    computed = plain.stats_now().tokens_computed
    assert computed <= s.tokens_computed <= computed + len(prompts)
    if name.startswith("json"):
        text = plain.detokenize(want[0])
        assert set(json.loads(text)) == set(SCHEMA["properties"])


def test_a_json_schemas_forced_tokens_are_drafted_without_any_guess(tiny_model_dir):
    """The real drafter on the tiny random model (which copies nothing): the schema's keys,
    quotes and colons are forced, drafted and kept, so the object takes fewer steps."""
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 1)
    sampling = CONSTRAINED["json_sampled"]
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    assert asyncio.run(_each(drafting, prompts, sampling, "d")) == want
    s = drafting.stats_now()
    assert s.draft_tokens_accepted >= 8  # the two keys alone are more tokens than that
    assert s.steps < plain.stats_now().steps


def test_wrong_drafts_are_cut_by_the_grammar_and_leave_constrained_tokens_unchanged(
    tiny_model_dir, always_drafts
):
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    sampling = CONSTRAINED["regex_sampled"]
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    assert asyncio.run(_each(drafting, prompts, sampling, "d")) == want


SAMPLED = {
    "sampled": SamplingParams(max_tokens=32, temperature=0.8, seed=11, ignore_eos=True),
    "top_p_top_k": SamplingParams(
        max_tokens=32, temperature=1.3, top_p=0.9, top_k=50, seed=5, ignore_eos=True
    ),
    "penalized_greedy": SamplingParams(
        max_tokens=32, frequency_penalty=0.7, presence_penalty=0.4, ignore_eos=True
    ),
    "penalized_sampled": SamplingParams(
        max_tokens=32, temperature=0.7, frequency_penalty=1.5, seed=2, ignore_eos=True
    ),
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampled_and_penalized_rows_keep_drafts_and_yield_the_plain_tokens(
    tiny_model_dir, oracle, name
):
    """A seeded sampled (or penalized) generation with drafts yields the tokens it yields
    without them: its sampler is called once per token, in order, so its generator and
    penalty counts advance as in plain decoding. Kept drafts save steps."""
    sampling = SAMPLED[name]
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    oracle.known = [p + w for p, w in zip(prompts, want, strict=True)]
    got = asyncio.run(_each(drafting, prompts, sampling, "d"))
    assert got == want
    s = drafting.stats_now()
    assert 0 < s.draft_tokens_accepted < s.draft_tokens
    assert s.steps < plain.stats_now().steps
    assert s.tokens_computed == plain.stats_now().tokens_computed
    # and the seed did matter: another seed (or no penalty) gives other tokens
    if sampling.seed is not None:
        other = dataclasses.replace(sampling, seed=sampling.seed + 1)
        assert asyncio.run(_each(plain, prompts, other, "o")) != want


@pytest.mark.parametrize("name", ["sampled", "penalized_sampled"])
def test_wrong_drafts_leave_sampled_tokens_unchanged(tiny_model_dir, always_drafts, name):
    sampling = SAMPLED[name]
    plain, drafting = _engines(tiny_model_dir)
    prompts = _prompts(plain, 2)
    want = asyncio.run(_each(plain, prompts, sampling, "p"))
    assert asyncio.run(_each(drafting, prompts, sampling, "d")) == want
    assert drafting.stats_now().draft_tokens > 0


def test_no_drafts_in_steps_with_more_decode_rows_than_allowed(tiny_model_dir, always_drafts):
    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=96, progress=False, speculate=4, speculate_rows=1
    )
    prompts = _prompts(engine, 3)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)

    async def run():
        async with engine:
            # three rows decode together in every step: none of them drafts
            await asyncio.gather(
                *(complete(engine, f"m{i}", p, sampling) for i, p in enumerate(prompts))
            )
            assert engine.stats_now().draft_tokens == 0
            await complete(engine, "alone", prompts[0], SamplingParams(max_tokens=24))
            assert engine.stats_now().draft_tokens > 0

    asyncio.run(run())


def test_a_background_row_beside_urgent_work_does_not_draft(tiny_model_dir, always_drafts):
    """A less urgent generation that rides along in a latency call's steps gets its
    share of the step, not drafts on top of it."""
    engine = Engine.from_pretrained(
        tiny_model_dir,
        num_blocks=96,
        progress=False,
        speculate=4,
        speculate_rows=8,
        background_tokens=1,
        background_every=0,
        urgent_linger=0,
    )
    prompts = _prompts(engine, 2)
    plan = []
    original = engine.scheduler.schedule

    def spy():
        work, finished, failed = original()
        plan.append([(w.req.priority, bool(w.draft)) for w in work])
        return work, finished, failed

    engine.scheduler.schedule = spy

    async def run():
        async with engine:
            await engine.fill("u", None, prompts[0])
            await engine.fill("b", None, prompts[1])
            s = SamplingParams(max_tokens=30, ignore_eos=True)
            await asyncio.gather(
                collect(engine, "u", None, s, priority=0),
                collect(engine, "b", None, s, priority=1),
            )

    asyncio.run(run())
    both = [step for step in plan if {p for p, _ in step} == {0, 1}]
    assert both, "the two generations never shared a step"
    assert not any(d for step in both for p, d in step if p == 1)
    assert any(d for step in plan for p, d in step if p == 0)


@pytest.mark.slow
def test_smollm2_summary_with_drafts_equals_transformers(smollm2_dir):
    """The real model on a summarisation prompt (copying from its context): drafts are
    kept, and the tokens are transformers' greedy ones."""
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(smollm2_dir, num_blocks=128, progress=False)
    text = (
        "You keep a running summary of a long document.\nNext part:\n"
        "The river town of Alder keeps a lantern fair each autumn. The lantern fair "
        "brings boats from the coast, and the boats carry oil, rope and glass. "
        "The glass makers of Alder sell lanterns to the boats.\nUpdated summary:"
    )
    prompt = engine.tokenize(text)
    got = asyncio.run(_each(engine, [prompt], SamplingParams(max_tokens=40), "s"))[0]
    s = engine.stats_now()
    assert s.draft_tokens_accepted > 0
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    eos = set(engine.eos_ids)
    assert got == [t for t in ref if t not in eos][: len(got)] and len(got) >= 1
    assert len(got) == len([t for t in ref if t not in eos])


@pytest.mark.slow
def test_smollm2_sampled_summary_with_drafts_equals_plain_sampling(smollm2_dir):
    """The real model and the real drafter, sampling with a seed at temperature 0.7: drafts
    are kept, and the text is the text of the same seed without drafts."""
    text = (
        "You keep a running summary of a long document.\nNext part:\n"
        "The river town of Alder keeps a lantern fair each autumn. The lantern fair "
        "brings boats from the coast, and the boats carry oil, rope and glass. "
        "The glass makers of Alder sell lanterns to the boats.\nUpdated summary:"
    )
    sampling = SamplingParams(max_tokens=40, temperature=0.7, seed=4)
    plain = Engine.from_pretrained(smollm2_dir, num_blocks=128, progress=False, speculate=0)
    drafting = Engine.from_pretrained(smollm2_dir, num_blocks=128, progress=False)
    prompt = plain.tokenize(text)
    want = asyncio.run(_each(plain, [prompt], sampling, "p"))[0]
    got = asyncio.run(_each(drafting, [prompt], sampling, "d"))[0]
    assert got == want and len(got) >= 8
    s = drafting.stats_now()
    assert s.draft_tokens_accepted > 0 and s.steps < plain.stats_now().steps


@pytest.mark.slow
def test_smollm2_json_extraction_with_drafts_equals_plain(smollm2_dir):
    """The real model fills a JSON schema from a text: forced keys and copied values are
    drafted and kept, and the object is the one plain constrained decoding gives."""
    schema = {
        "type": "object",
        "properties": {
            "town": {"type": "string", "maxLength": 20},
            "fair": {"type": "string", "maxLength": 20},
            "goods_carried_by_the_boats": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 4,
            },
        },
        "required": ["town", "fair", "goods_carried_by_the_boats"],
    }
    text = (
        "The river town of Alder keeps a lantern fair each autumn. The lantern fair "
        "brings boats from the coast, and the boats carry oil, rope and glass.\n"
        "The facts above as JSON:\n"
    )
    sampling = SamplingParams(
        max_tokens=96, constraint=Constraint("json_schema", json.dumps(schema))
    )
    plain = Engine.from_pretrained(smollm2_dir, num_blocks=128, progress=False, speculate=0)
    drafting = Engine.from_pretrained(smollm2_dir, num_blocks=128, progress=False)
    prompt = plain.tokenize(text)
    want = asyncio.run(_each(plain, [prompt], sampling, "p"))[0]
    assert asyncio.run(_each(drafting, [prompt], sampling, "d"))[0] == want
    value = json.loads(plain.detokenize(want))
    assert set(value) == set(schema["properties"])
    s = drafting.stats_now()
    assert s.draft_tokens_accepted > 0 and s.steps < plain.stats_now().steps


@pytest.mark.parametrize("speculate", [0, 4])
def test_drafts_never_evict_or_preempt(tiny_model_dir, always_drafts, speculate):
    """With no free block, a draft that would cross into a new block is dropped: an idle
    context's KV is released when the generation's own next token needs the block, at
    the same length as without drafts, not when a draft first reaches it."""
    engine = Engine.from_pretrained(
        tiny_model_dir,
        num_blocks=3,
        progress=False,
        prefix_cache=False,
        speculate=speculate,
        speculate_rows=8,
    )
    released_at = []
    release = engine.scheduler.release

    def spy(ctx):
        released_at.append(len(engine.contexts["g"].tokens))
        release(ctx)

    engine.scheduler.release = spy
    idle, prompt = _prompts(engine, 7)[5:7]  # 29 and 33 tokens: 2 blocks each ...

    async def run():
        async with engine:
            await engine.fill("idle", None, idle[:32])  # ... the idle context holds 2
            await engine.fill("g", None, prompt[:12])  # and the generation 1 of the 3
            tokens = await collect(engine, "g", None, SamplingParams(max_tokens=8))
            return tokens[0], engine.stats_now()

    tokens, stats = asyncio.run(run())
    assert len(tokens) == 8 and stats.preemptions == 0
    # position 16, the first of the second block, is computed in the step when the context
    # holds 17 tokens: that step evicts (with drafts as reserved as plain tokens, a
    # step at 13 tokens, drafting positions 13-16, would have)
    assert released_at == [17]
    if speculate:
        assert stats.draft_tokens > 0
