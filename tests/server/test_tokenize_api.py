"""The tokenizer over HTTP (`/tokenize`, `/detokenize`, `/tokenizer_info`, vLLM's paths) on
the real engine (tiny model): the ids are those the OpenAI routes count and compute, bad
input is a 400 naming the field, and the remote-tokenizer flow an evaluation harness runs
(info, tokenize, score the ids with echo + logprobs) works end to end."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.server import ServerSettings, create_app

pytestmark = pytest.mark.timeout(240)

KEY = "sk-tok-alice"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        tiny_model_dir, num_blocks=128, progress=False, device="cpu", dtype="float32"
    )


@pytest.fixture
async def client(engine):
    await engine.start()
    app = create_app(engine, settings=ServerSettings(api_keys={KEY: "alice"}))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=AUTH, timeout=60
        ) as c:
            yield c
    finally:
        await engine.stop()
    assert engine.contexts == {}


TEXT = "The parrot said: {hello} <|im_end|> again"


async def test_tokenize_gives_the_ids_completions_count(client, engine):
    r = await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.tokenize(TEXT)
    assert body["count"] == len(body["tokens"]) > 3
    assert body["max_model_len"] == engine.max_model_len
    special = {i: s for s, i in engine.special_token_ids.items()}
    assert body["token_strs"] == [special.get(t) or engine.detokenize([t]) for t in body["tokens"]]
    assert "<|im_end|>" in body["token_strs"]  # spelled, not "" (detokenize drops it)
    c = await client.post(
        "/v1/completions",
        json={"model": engine.model_name, "prompt": TEXT, "max_tokens": 1, "temperature": 0},
    )
    assert c.status_code == 200, c.text
    assert c.json()["usage"]["prompt_tokens"] == body["count"]
    # the same ids as a token-id prompt give the same completion
    ids = await client.post(
        "/v1/completions",
        json={
            "model": engine.model_name,
            "prompt": body["tokens"],
            "max_tokens": 1,
            "temperature": 0,
        },
    )
    assert ids.json()["choices"][0]["text"] == c.json()["choices"][0]["text"]
    # without token_strs, the field is left out
    plain = (await client.post("/tokenize", json={"prompt": "hi"})).json()
    assert "token_strs" not in plain and plain["tokens"] == engine.tokenize("hi")


async def test_tokenize_messages_counts_as_chat_completions(client, engine):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a parrot."},
    ]
    r = await client.post("/tokenize", json={"model": engine.model_name, "messages": messages})
    assert r.status_code == 200, r.text
    chat = await client.post(
        "/v1/chat/completions",
        json={"model": engine.model_name, "messages": messages, "max_tokens": 1},
    )
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    no_prompt = await client.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    )
    assert no_prompt.json()["count"] <= r.json()["count"]


async def test_tokenize_messages_with_tools_counts_as_chat_completions(client, engine):
    """Tools are rendered into the prompt unless tool_choice is 'none' (then the model is
    not told of them): /tokenize takes tool_choice too, so its count is chat's."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    counts = {}
    for choice in (None, "none", "auto"):
        extra = {} if choice is None else {"tool_choice": choice}
        r = await client.post("/tokenize", json={"messages": messages, "tools": tools, **extra})
        assert r.status_code == 200, r.text
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": engine.model_name,
                "messages": messages,
                "tools": tools,
                "max_tokens": 1,
                **extra,
            },
        )
        assert chat.status_code == 200, chat.text
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"], choice
        counts[choice] = r.json()["count"]
    assert counts["none"] < counts["auto"] == counts[None]


async def test_detokenize_round_trips(client, engine):
    ids = engine.tokenize("Parrots live in flocks.")
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "Parrots live in flocks."}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
    # special tokens are spelled (they were dropped): /tokenize's ids give the text back
    ids = (await client.post("/tokenize", json={"prompt": TEXT})).json()["tokens"]
    assert len(ids) < len(engine.tokenize(TEXT.replace("<|im_end|>", "<|im_end |>")))
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}


async def test_tokenizer_info_names_the_special_tokens(client, engine):
    r = await client.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["model"] == engine.model_name
    assert info["eos_token"] == engine.special_tokens["eos_token"] and info["eos_token"]
    assert info["pad_token"] == (engine.tokenizer.pad_token or None)
    assert info["model_max_length"] == engine.max_model_len
    assert info["vocab_size"] == engine.vocab_size
    assert info["chat_template"] == engine.chat_template


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),  # neither prompt nor messages
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", '{"prompt": "bad \\ud800 surrogate"}', "prompt"),  # a lone surrogate
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    if isinstance(body, str):  # JSON text httpx would not encode
        r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] is not None and param in err["param"], err
    else:
        assert "prompt or messages" in err["message"], err


async def test_an_unknown_model_is_a_404_and_a_missing_key_a_401(client, engine):
    r = await client.post("/tokenize", json={"model": "gpt-nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = await client.post("/detokenize", json={"model": "gpt-nope", "tokens": [1]})
    assert r.status_code == 404
    for method, path in [("GET", "/tokenizer_info"), ("POST", "/tokenize")]:
        r = await client.request(method, path, json={"prompt": "x"}, headers={"Authorization": ""})
        assert r.status_code == 401, (path, r.status_code)


async def test_a_harness_scores_ids_it_got_from_the_server(client, engine):
    """The remote-tokenizer flow of lm-evaluation-harness's `local-completions`: it uses
    the server's tokenizer when /tokenizer_info names an eos_token and /tokenize answers
    ids; then it sends context + continuation ids with echo, logprobs 1, max_tokens 1 and
    sums the continuation's token logprobs (the last entry, the generated token, left out)."""
    info = (await client.get("/tokenizer_info")).json()
    assert "eos_token" in info
    probe = await client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert isinstance(probe.json()["tokens"], list)

    async def ids(text: str) -> list[int]:
        return (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]

    context, continuation = await ids("The parrot said"), await ids(" hello")
    r = await client.post(
        "/v1/completions",
        json={
            "model": engine.model_name,
            "prompt": [context + continuation],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(context)
    assert lp["token_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == n + len(continuation) + 1
    picked = lp["token_logprobs"][n:-1]
    assert len(picked) == len(continuation) and all(v <= 0 for v in picked)
    # the same prompt scored with max_tokens 0 gives the same entries for the prompt
    again = await client.post(
        "/v1/completions",
        json={
            "model": engine.model_name,
            "prompt": context + continuation,
            "max_tokens": 0,
            "logprobs": 1,
            "echo": True,
        },
    )
    assert again.json()["choices"][0]["logprobs"]["token_logprobs"][n:] == pytest.approx(
        picked, abs=1e-5
    )
