"""Log probabilities on the OpenAI routes, through the official client, on the real engine
(tiny random Llama, drafts on as on any CPU): completions' `{tokens, token_logprobs,
top_logprobs, text_offset}` and chat's `{content: [{token, logprob, bytes,
top_logprobs}]}`, streamed and not, n=2, JSON mode and tool calls, and over a remote
engine. The numbers are checked against transformers' log-softmax."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from parrot_backend.server import ServerSettings, create_app

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def greedy(prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy tokens and the log-softmax at each of their positions."""
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
        return ids[len(prompt) :], torch.log_softmax(logits, -1)

    return greedy


def _client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http)


@pytest.fixture
async def client(engine):
    await engine.start()
    try:
        yield _client(create_app(engine, settings=ServerSettings()))
    finally:
        await engine.stop()
    assert engine.contexts == {}


PROMPT = "The parrot said"
MESSAGES = [{"role": "user", "content": "Name a parrot."}]


def _greedy_completion_kw(engine, **kw):
    return {
        "model": engine.model_name,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
        **kw,
    }


async def test_completions_logprobs_match_transformers_and_the_stream(client, engine, reference):
    kw = _greedy_completion_kw(engine, logprobs=3, n=2)
    r = await client.completions.create(**kw)
    tokens, lps = reference(engine.tokenize(PROMPT), 8)
    texts = [engine.detokenize([t]) for t in tokens]
    assert r.usage.completion_tokens == 16
    for choice in r.choices:
        lp = choice.logprobs
        assert lp.tokens == texts
        assert lp.token_logprobs == pytest.approx(
            [float(lps[i, t]) for i, t in enumerate(tokens)], abs=ATOL
        )
        offsets = [sum(len(t) for t in texts[:i]) for i in range(8)]
        assert lp.text_offset == offsets
        for i, top in enumerate(lp.top_logprobs):
            # the top 3 by text (greedy: the chosen token is the first of them)
            want = torch.topk(lps[i], 3)
            assert list(top.values()) == pytest.approx(want.values.tolist(), abs=ATOL)
            assert top[texts[i]] == pytest.approx(lp.token_logprobs[i], abs=ATOL)
            assert max(top.values()) == top[texts[i]]
    # streamed: each chunk carries its tokens' entries, and they add up to the same
    stream = await client.completions.create(**kw, stream=True)
    got = {0: {"tokens": [], "token_logprobs": [], "text_offset": [], "top": []}, 1: None}
    got[1] = {k: [] for k in got[0]}
    text = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            assert c.logprobs is not None
            got[c.index]["tokens"] += c.logprobs.tokens
            got[c.index]["token_logprobs"] += c.logprobs.token_logprobs
            got[c.index]["text_offset"] += c.logprobs.text_offset
            got[c.index]["top"] += c.logprobs.top_logprobs
    for choice in r.choices:
        g = got[choice.index]
        assert text[choice.index] == choice.text
        assert g["tokens"] == choice.logprobs.tokens
        assert g["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=ATOL)
        assert g["text_offset"] == choice.logprobs.text_offset
        assert [list(t) for t in g["top"]] == [list(t) for t in choice.logprobs.top_logprobs]


async def test_completions_without_logprobs_say_null(client, engine):
    r = await client.completions.create(**_greedy_completion_kw(engine))
    assert r.choices[0].logprobs is None


async def test_chat_logprobs_n2_streamed_and_not(client, engine):
    kw = {
        "model": engine.model_name,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    r = await client.chat.completions.create(**kw)
    assert r.usage.completion_tokens == 16
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 8
        for entry in content:
            assert entry.logprob <= 0
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].token == entry.token  # greedy: the argmax
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=ATOL)
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        joined = "".join(e.token for e in content)
        if "\ufffd" not in joined:  # (a token alone may end inside a character)
            assert joined == choice.message.content
    # the two greedy choices are the same tokens
    first, second = (c.logprobs.content for c in r.choices)
    assert [e.token for e in first] == [e.token for e in second]
    stream = await client.chat.completions.create(**kw, stream=True)
    streamed: dict[int, list] = {0: [], 1: []}
    async for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.content
    for choice in r.choices:
        want = [(e.token, round(e.logprob, 4)) for e in choice.logprobs.content]
        got = [(e.token, round(e.logprob, 4)) for e in streamed[choice.index]]
        assert got == want


async def test_sampled_chat_choices_have_their_own_logprobs(client, engine):
    r = await client.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        seed=3,
        n=2,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    for choice in r.choices:
        assert len(choice.logprobs.content) == 10
        assert all(e.top_logprobs == [] and e.logprob <= 0 for e in choice.logprobs.content)


async def test_json_mode_and_tool_calls_carry_the_logprobs_of_their_tokens(client, engine):
    base = {"model": engine.model_name, "messages": MESSAGES, "temperature": 0, "logprobs": True}
    r = await client.chat.completions.create(
        **base, max_tokens=30, response_format={"type": "json_object"}, top_logprobs=1
    )
    content = r.choices[0].logprobs.content
    # every generated token but an EOS that ended it has its entry
    eos = 1 if r.choices[0].finish_reason == "stop" else 0
    assert r.usage.completion_tokens - eos <= len(content) <= r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 1 for e in content)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    kw = {**base, "max_tokens": 40, "tools": tools, "tool_choice": "required"}
    r = await client.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls
    entries = r.choices[0].logprobs.content
    assert len(entries) >= r.usage.completion_tokens - 1
    stream = await client.chat.completions.create(**kw, stream=True)
    streamed, calls = [], 0
    async for chunk in stream:
        for c in chunk.choices:
            calls += bool(c.delta.tool_calls)
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert calls > 0
    assert [e.token for e in streamed] == [e.token for e in entries]


async def test_logprobs_requests_that_are_refused(client, engine):
    model = engine.model_name
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=model, messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt=PROMPT, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(
            model=model, prompt=PROMPT, logprobs=21, echo=True, max_tokens=0
        )
    # max_tokens 0 asks for the prompt alone: only with echo
    with pytest.raises(openai.BadRequestError, match="echo") as info:
        await client.completions.create(model=model, prompt=PROMPT, logprobs=1, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


async def test_an_engine_without_logprobs_is_a_400_naming_it():
    from parrot_backend.testing.fake_engine import FakeEngine

    fake = FakeEngine()
    client = _client(create_app(fake, settings=ServerSettings()))
    with pytest.raises(openai.BadRequestError, match="FakeEngine.*log probabilities"):
        await client.chat.completions.create(
            model=fake.model_name, messages=MESSAGES, logprobs=True
        )


async def test_logprobs_over_a_remote_engine(engine, tiny_model_dir, reference):
    """The engine API carries them (`wire.delta_frame`): a server on a RemoteEngine answers
    with the numbers the engine computed."""
    from parrot_backend.contract.sampling import SamplingParams
    from parrot_backend.engines.remote import RemoteEngine
    from parrot_backend.server.engine_api import create_engine_app

    key = "sk-logprobs"
    async with engine:
        app = create_engine_app(engine, api_key=key)
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://e",
            headers={"Authorization": f"Bearer {key}"},
        )
        info = (await http.get("/engine/info")).json()
        remote = RemoteEngine(
            "http://e", api_key=key, info=info, tokenizer=engine.tokenizer, client=http
        )
        prompt = engine.tokenize(PROMPT)
        await remote.fill("r", None, prompt)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4)
        deltas = [d async for d in remote.generate("r", None, sampling)]
        tokens, lps = reference(prompt, 6)
        assert [d.token_id for d in deltas] == tokens
        for i, d in enumerate(deltas):
            assert d.logprob == pytest.approx(float(lps[i, d.token_id]), abs=ATOL)
            assert [t for t, _ in d.top_logprobs] == torch.topk(lps[i], 4).indices.tolist()
        await remote.free("r")
        # and the OpenAI route on top of it
        client = _client(create_app(remote, settings=ServerSettings()))
        r = await client.chat.completions.create(
            model=remote.model_name,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        assert len(r.choices[0].logprobs.content) == 5
        assert json.loads(r.model_dump_json())["choices"][0]["logprobs"]["content"][0]["bytes"]
        await http.aclose()
    assert engine.contexts == {}


# ---- the prompt's logprobs: legacy completions' echo with logprobs ----


@pytest.fixture(scope="module")
def scores(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """transformers' log-softmax at every position of `ids`."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)

    return logprobs


def _check_echoed(engine, lp, ids: list[int], k: int, scores, generated: int = 0) -> None:
    """The prompt's entries first (the first null), then the generated tokens', all equal
    to transformers' log-softmax; offsets from 0 over the token texts."""
    assert len(lp.tokens) == len(ids) + generated
    texts = [engine.detokenize([t]) for t in ids]
    assert lp.tokens[: len(ids)] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    every = ids + [engine.tokenize(t)[0] for t in lp.tokens[len(ids) :]] if generated else ids
    ref = scores(every)
    for i in range(1, len(lp.tokens)):
        t = every[i]
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, t]), abs=ATOL), i
        top = lp.top_logprobs[i]
        best = torch.topk(ref[i - 1], k)
        want = dict(zip(best.indices.tolist(), best.values.tolist(), strict=True))
        want.setdefault(t, float(ref[i - 1, t]))
        assert set(top) == {engine.detokenize([w]) for w in want}
        for w, v in want.items():
            assert top[engine.detokenize([w])] == pytest.approx(v, abs=ATOL)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets


async def test_echo_with_logprobs_scores_the_prompt(client, engine, scores, reference):
    ids = engine.tokenize(PROMPT)
    kw = {
        "model": engine.model_name,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 2,
        "temperature": 0,
    }
    r = await client.completions.create(**kw, max_tokens=0, n=2)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    for choice in r.choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        _check_echoed(engine, choice.logprobs, ids, 2, scores)
        assert "".join(choice.logprobs.tokens) == PROMPT  # this tokenizer round-trips it
    # with generated tokens after it (greedy: transformers' tokens)
    r3 = await client.completions.create(**kw, max_tokens=3, extra_body={"ignore_eos": True})
    choice = r3.choices[0]
    tokens, _ = reference(ids, 3)
    generated = engine.detokenize(tokens)
    assert choice.text == PROMPT + generated
    assert choice.logprobs.tokens[len(ids) :] == [engine.detokenize([t]) for t in tokens]
    _check_echoed(engine, choice.logprobs, ids, 2, scores, generated=3)
    assert r3.usage.completion_tokens == 3
    # a prompt given as token ids: the same answer
    by_ids = await client.completions.create(**{**kw, "prompt": ids}, max_tokens=0)
    assert by_ids.choices[0].text == PROMPT
    assert by_ids.choices[0].logprobs == r.choices[0].logprobs
    # streamed: each choice's first chunk carries the echoed prompt and its entries
    for max_tokens in (0, 3):
        want = r if max_tokens == 0 else r3
        n = 2 if max_tokens == 0 else 1
        stream = await client.completions.create(
            **kw, max_tokens=max_tokens, n=n, stream=True, extra_body={"ignore_eos": True}
        )
        got: dict[int, dict] = {}
        async for chunk in stream:
            for c in chunk.choices:
                g = got.setdefault(
                    c.index, {"text": "", "tokens": [], "lps": [], "top": [], "offsets": []}
                )
                if not g["text"] and c.text:  # the first chunk with text: the prompt's entries
                    assert c.text.startswith(PROMPT)
                    assert (
                        c.logprobs.tokens[: len(ids)] == want.choices[0].logprobs.tokens[: len(ids)]
                    )
                g["text"] += c.text
                g["tokens"] += c.logprobs.tokens
                g["lps"] += c.logprobs.token_logprobs
                g["top"] += c.logprobs.top_logprobs
                g["offsets"] += c.logprobs.text_offset
        assert sorted(got) == list(range(n))
        for g in got.values():
            lp = want.choices[0].logprobs
            assert g["text"] == want.choices[0].text
            assert g["tokens"] == lp.tokens and g["offsets"] == lp.text_offset
            assert g["lps"][0] is None and g["top"][0] is None
            assert g["lps"][1:] == pytest.approx(lp.token_logprobs[1:], abs=ATOL)
            assert [dict(t) for t in g["top"][1:]] == [dict(t) for t in lp.top_logprobs[1:]]


async def test_echo_with_max_tokens_zero_and_no_logprobs_is_the_prompt(client, engine):
    r = await client.completions.create(
        model=engine.model_name, prompt=PROMPT, echo=True, max_tokens=0, n=2
    )
    assert [c.text for c in r.choices] == [PROMPT, PROMPT]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 0
    stream = await client.completions.create(
        model=engine.model_name, prompt=PROMPT, echo=True, max_tokens=0, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_prompt_logprobs_over_a_remote_engine(engine, tiny_model_dir, scores):
    """A fill's `prompt_logprobs` go to the engine API and its entries come back (`wire`)."""
    from parrot_backend.contract.engine import ScoredFill
    from parrot_backend.engines.remote import RemoteEngine
    from parrot_backend.server.engine_api import create_engine_app

    key = "sk-prompt"
    async with engine:
        app = create_engine_app(engine, api_key=key)
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://e",
            headers={"Authorization": f"Bearer {key}"},
        )
        info = (await http.get("/engine/info")).json()
        remote = RemoteEngine(
            "http://e", api_key=key, info=info, tokenizer=engine.tokenizer, client=http
        )
        prompt = engine.tokenize(PROMPT)
        filled = await remote.fill("r", None, prompt, prompt_logprobs=3)
        await remote.free("r")
        assert isinstance(filled, ScoredFill) and filled.length == len(prompt)
        entries = filled.prompt_logprobs
        # a plain fill's answer is as before: the length alone
        plain = await http.post("/engine/fill", json={"context_id": "p", "token_ids": prompt})
        assert plain.json() == {"length": len(prompt)}
        assert await remote.fill("p", None, [5]) == len(prompt) + 1
        await remote.free("p")
        ref = scores(prompt)
        assert entries[0] is None and len(entries) == len(prompt)
        for i in range(1, len(prompt)):
            assert entries[i][0] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=ATOL)
            assert [t for t, _ in entries[i][1]] == torch.topk(ref[i - 1], 3).indices.tolist()
        # and echo with logprobs on the OpenAI route on top of it
        client = _client(create_app(remote, settings=ServerSettings()))
        r = await client.completions.create(
            model=remote.model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
        )
        assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
            [e[0] for e in entries[1:]], abs=ATOL
        )
        await http.aclose()
    assert engine.contexts == {}


@pytest.mark.parametrize(("n", "max_tokens"), [(1, 3), (2, 3), (2, 0)])
async def test_echo_with_logprobs_computes_the_prompt_once(client, engine, n, max_tokens):
    """The fill that computes the prompt scores it: the choices (n=1 on the filled context,
    n=2 forks of it) reuse its KV, and max_tokens 0 runs the fill alone. The engine's
    prefill counter shows the prompt's tokens once, not once more per choice."""
    # a prompt of its own (nothing of it cached by an earlier test)
    prompt = f"{PROMPT} once, with n={n} and max_tokens={max_tokens}"
    ids = engine.tokenize(prompt)
    before = engine.stats_now()
    r = await client.completions.create(
        model=engine.model_name,
        prompt=prompt,
        echo=True,
        logprobs=1,
        temperature=0,
        n=n,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    after = engine.stats_now()
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(ids)
    assert after.tokens_generated - before.tokens_generated == n * max_tokens
    for c in r.choices:
        assert c.logprobs.tokens[: len(ids)] == [engine.detokenize([t]) for t in ids]
        assert c.logprobs.token_logprobs[0] is None
        assert None not in c.logprobs.token_logprobs[1:]
        # the same entries of the prompt on every choice
        assert (
            c.logprobs.token_logprobs[: len(ids)]
            == r.choices[0].logprobs.token_logprobs[: len(ids)]
        )


async def test_a_generated_eos_has_its_entry_in_completions_not_in_chat(client, engine):
    """lm-evaluation-harness scores `token_logprobs[ctx:-1]` of a 1-token generation with
    echo: the last entry must be the generated token, also when it is the EOS (without
    its entry, the continuation's last token was dropped from the score). Chat lists no
    EOS, as OpenAI's chat does not."""
    (eos,) = sorted(engine.eos_ids)[:1]
    ids = engine.tokenize(PROMPT)
    r = await client.completions.create(
        model=engine.model_name,
        prompt=ids,
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0,
        logit_bias={str(eos): 100},  # the EOS is the greedy pick
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens == 1
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.tokens[-1] == {i: s for s, i in engine.special_token_ids.items()}[eos]
    assert lp.token_logprobs[-1] is not None and lp.token_logprobs[-1] <= 0
    # its logprob is the model's: what a plain 1-token request reports for that token
    plain = await client.completions.create(
        model=engine.model_name, prompt=ids, logprobs=5, max_tokens=1, temperature=0
    )
    alternatives = plain.choices[0].logprobs.top_logprobs[0]
    if lp.tokens[-1] in alternatives:
        assert lp.token_logprobs[-1] == pytest.approx(alternatives[lp.tokens[-1]], abs=1e-4)
    assert c.text == engine.detokenize(ids)  # the EOS is not in the text
    assert lp.text_offset[-1] == len(c.text)
    chat = await client.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        logprobs=True,
        max_tokens=3,
        temperature=0,
        logit_bias={str(eos): 100},
    )
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    assert chat.choices[0].logprobs.content == []


async def test_echoed_special_tokens_are_spelled_and_offsets_index_the_text(client, engine):
    """A prompt with special tokens, as ids or as text: the echoed text spells them, each
    prompt token's entry is its text there, and every `text_offset` indexes the text."""
    special = {i: s for s, i in engine.special_token_ids.items()}
    (eos,) = sorted(engine.eos_ids)[:1]
    start = next(i for i in special if i not in engine.eos_ids)
    middle = engine.tokenize("user\nName a parrot.")
    ids = [start, *middle, eos]
    text = special[start] + engine.detokenize(middle) + special[eos]
    assert engine.tokenize(text) == ids
    for prompt in (ids, text):
        r = await client.completions.create(
            model=engine.model_name,
            prompt=prompt,
            echo=True,
            logprobs=0,
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        c = r.choices[0]
        assert c.text.startswith(text)
        lp = c.logprobs
        assert lp.tokens[: len(ids)] == [special.get(t) or engine.detokenize([t]) for t in ids]
        for k, (token, offset) in enumerate(zip(lp.tokens, lp.text_offset, strict=True)):
            if "\ufffd" in token or (k >= len(ids) and token in special.values()):
                continue  # a partial character; a generated special token (not in the text)
            assert c.text[offset : offset + len(token)] == token, (k, token, offset, c.text)


SPLIT = "Parrots 🦜🎉 say 日本語, then 🦜 ok"


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Offsets never decrease, stay within the text, and every token whose text is whole
    (no U+FFFD of a split character) is at its place in the text."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for k, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (k, token, offset, text)


async def test_echoed_offsets_index_the_text_after_split_characters(client, engine):
    """Emoji and CJK split over several tokens, each spelled U+FFFD alone: the tokens
    after them are still at their place in the echoed text (their offsets used to add one
    per U+FFFD, running past the text), streamed and not."""
    ids = engine.tokenize(SPLIT)
    assert sum("\ufffd" in engine.detokenize([t]) for t in ids) >= 4  # really split
    for prompt in (SPLIT, ids):
        kw = dict(model=engine.model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        c = (await client.completions.create(**kw)).choices[0]
        assert c.text == SPLIT
        _check_offsets(c.text, c.logprobs.tokens, c.logprobs.text_offset)
        assert c.logprobs.text_offset[-1] == SPLIT.index(" ok")
        text, tokens, offsets = "", [], []
        async for chunk in await client.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                text += ch.text
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    offsets += ch.logprobs.text_offset
        assert (text, tokens, offsets) == (c.text, c.logprobs.tokens, c.logprobs.text_offset)


def test_generated_offsets_index_the_text_after_split_characters(engine):
    """The same for generated tokens, given chunk by chunk (a stream's deltas): a split
    character held over a chunk's end still lands where the text has it."""
    from parrot_backend.contract.engine import TokenDelta
    from parrot_backend.server.openai_logprobs import CompletionOffsets, TokenTexts

    ids = engine.tokenize(SPLIT)
    offsets = CompletionOffsets(TokenTexts(engine))
    tokens, got = [], []
    for start in range(0, len(ids), 3):
        deltas = [TokenDelta(t, "", logprob=-1.0) for t in ids[start : start + 3]]
        out = offsets.take(deltas)
        tokens += out.tokens
        got += out.text_offset
    _check_offsets(SPLIT, tokens, got)
    assert got[-1] == SPLIT.index(" ok")


@pytest.mark.parametrize("batched", [False, True])
async def test_a_multiple_choice_context_is_computed_once(client, engine, scores, batched):
    """lm-eval's multiple choice: one context scored with each of 4 answers, as 4 requests
    one after another or as one batch of 4 prompts. The context's full blocks are computed
    once (the later prompts take them and their kept scores from the prefix cache), and
    every answer's entries equal transformers'."""
    bs = engine.pool.block_size
    # (its own text from the first token: no block of it cached by another test)
    context = engine.tokenize(f"Multiple choice, batched={batched}: {PROMPT}? " * 3)
    answers = [engine.tokenize(f" answer {a}" * (a + 1)) for a in range(4)]
    prompts = [context + a for a in answers]
    kw = {"model": engine.model_name, "echo": True, "logprobs": 1, "max_tokens": 0}
    before = engine.stats_now().prefill_tokens_computed
    reused = engine.stats_now().prompt_scores_reused
    hits = engine.stats_now().prefix_cache_hits
    if batched:
        r = await client.completions.create(**kw, prompt=prompts)
        choices = sorted(r.choices, key=lambda c: c.index)
    else:
        choices = [(await client.completions.create(**kw, prompt=p)).choices[0] for p in prompts]
    computed = engine.stats_now().prefill_tokens_computed - before
    shared = len(context) // bs * bs
    assert shared >= 2 * bs
    # each later prompt computes its own tokens and the last cached position once more
    assert computed == sum(len(p) for p in prompts) - 3 * (shared - 1)
    # and took those tokens' scores from the kept ones (the first token has none)
    assert engine.stats_now().prompt_scores_reused - reused == 3 * (shared - 1)
    # (once each, although a prompt of the batch waits for a block and is matched again)
    assert engine.stats_now().prefix_cache_hits - hits == 3 * shared
    for choice, ids in zip(choices, prompts, strict=True):
        _check_echoed(engine, choice.logprobs, ids, 1, scores)
