"""`logit_bias` on the OpenAI routes (real engine, tiny model, the openai client): a large
bias forces a token, a ban moves a greedy decode off its first token exactly as the
engine does with the same pairs, chat and completions, streamed and not, batched prompts
too; logprobs stay the model's."""

from __future__ import annotations

import httpx
import openai
import pytest

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.server import ServerSettings, create_app

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        tiny_model_dir, num_blocks=128, progress=False, device="cpu", dtype="float32"
    )


@pytest.fixture
async def client(engine):
    await engine.start()
    app = create_app(engine, settings=ServerSettings())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    try:
        yield openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http)
    finally:
        await http.aclose()
        await engine.stop()
    assert engine.contexts == {}


PROMPT = "The parrot said"


async def _engine_greedy(engine, prompt: list[int], n: int, bias=()) -> list[int]:
    await engine.fill("ref", None, prompt)
    sampling = SamplingParams(max_tokens=n, ignore_eos=True, logit_bias=tuple(bias))
    out = [d.token_id async for d in engine.generate("ref", None, sampling)]
    await engine.free("ref")
    return out


async def test_a_large_bias_forces_a_token(client, engine):
    kw = {"model": engine.model_name, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    r = await client.completions.create(
        prompt=PROMPT, temperature=1.0, seed=3, logit_bias={"42": 100}, **kw
    )
    assert r.choices[0].text == engine.detokenize([42] * 5)
    chat = await client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], temperature=0, logit_bias={"77": 100}, **kw
    )
    assert chat.choices[0].message.content == engine.detokenize([77] * 5)
    texts = []
    stream = await client.completions.create(
        prompt=[PROMPT, "Another one"], temperature=0, logit_bias={"42": 100}, stream=True, **kw
    )
    async for chunk in stream:
        for ch in chunk.choices:
            texts.append((ch.index, ch.text))
    for index in (0, 1):
        assert "".join(t for i, t in texts if i == index) == engine.detokenize([42] * 5)


async def test_a_ban_moves_the_greedy_decode_as_the_engine_does(client, engine):
    ids = engine.tokenize(PROMPT)
    plain = await _engine_greedy(engine, ids, 6)
    bias = {plain[0]: -100.0, plain[2]: 3.0}
    want = await _engine_greedy(engine, ids, 6, bias.items())
    assert want[0] != plain[0]
    r = await client.completions.create(
        model=engine.model_name,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.text == engine.detokenize(want)
    # the logprob of the banned-away first pick is the model's own, not the biased one
    unbiased = await client.completions.create(
        model=engine.model_name,
        prompt=ids,
        max_tokens=1,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    top = unbiased.choices[0].logprobs.top_logprobs[0]
    first = engine.detokenize([want[0]])
    if first in top:
        assert choice.logprobs.token_logprobs[0] == pytest.approx(top[first], abs=1e-4)
    assert choice.logprobs.token_logprobs[0] < max(top.values())


async def test_bad_bias_is_a_400_naming_logit_bias(client, engine):
    for bias in (
        {"x": 1},
        {"5": 101},
        {str(engine.vocab_size): 1},
        {"5": 1, " 5": 2},
        {"\u0663": 1},  # an Arabic-Indic 3: int() reads it, it is no token id
        {"\u00b2": 1},  # a superscript 2: isdigit() passes it, int() refuses it
        {"--5": 1},
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(
                model=engine.model_name, prompt=PROMPT, max_tokens=2, logit_bias=bias
            )
        assert err.value.body["param"] == "logit_bias", (bias, err.value.body)
