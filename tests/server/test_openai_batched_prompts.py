"""Batched prompts on `POST /v1/completions` (OpenAI's legacy API), on the real engine (tiny
random Llama): a `prompt` that is a list of strings or of token id lists gives
`len(prompts) * n` choices, prompt i's choice j at index `i * n + j`, each as a
single-prompt request gives it (text, echo, logprobs, finish reason); usage sums over all.
lm-evaluation-harness's `local-completions` payloads (loglikelihood: echo, logprobs 1,
max_tokens 1; generation: prompts with stop and seed), the openai client, bad prompts
(a 400 naming the prompt, before any engine work), the cap, engine failures and
disconnects (every run closed, no context left)."""

from __future__ import annotations

import json
import socket
from operator import itemgetter

import httpx
import openai
import pytest
import torch

from parrot_backend.contract.errors import OutOfMemory
from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.errors import APIError
from parrot_backend.server.limits import InflightLimiter

from .conftest import LiveServer, wait_until

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4
PROMPTS = ["The parrot said", "Once upon a time in a land far away", "Hi"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from parrot_backend.engine.engine import Engine

    return Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )


@pytest.fixture(scope="module")
def scores(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """transformers' log-softmax at every position of `ids`."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)

    return logprobs


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.fixture
async def http(engine):
    await engine.start()
    try:
        async with _http(create_app(engine, settings=ServerSettings())) as c:
            yield c
    finally:
        await engine.stop()
    assert engine.contexts == {}


async def _post(http, **body) -> dict:
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _stream(http, **body) -> tuple[dict[int, dict], list[dict]]:
    """Each choice's text and finish reason (and logprobs lists) put together from the
    chunks, and the chunks."""
    got: dict[int, dict] = {}
    chunks = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
            for c in chunk["choices"]:
                g = got.setdefault(c["index"], {"text": "", "finish": None, "lp": None})
                g["text"] += c["text"]
                if c["finish_reason"] is not None:
                    assert g["finish"] is None
                    g["finish"] = c["finish_reason"]
                if c["logprobs"] is not None:
                    lp = g["lp"] or {k: [] for k in c["logprobs"]}
                    for k, v in c["logprobs"].items():
                        lp[k] += v
                    g["lp"] = lp
    return got, chunks


def _quiet(engine) -> bool:
    s = engine.stats_now()
    return not engine.contexts and s.running == 0 and s.waiting == 0


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("n", [1, 2])
async def test_each_choice_is_what_its_prompt_alone_gives(http, engine, n, as_ids):
    prompts = [engine.tokenize(p) for p in PROMPTS] if as_ids else PROMPTS
    kw = {"model": engine.model_name, "temperature": 0, "max_tokens": 6, "n": n}
    singles = [await _post(http, **kw, prompt=p) for p in prompts]
    batch = await _post(http, **kw, prompt=prompts)
    assert [c["index"] for c in batch["choices"]] == list(range(len(prompts) * n))
    for i, single in enumerate(singles):
        for j in range(n):
            got = batch["choices"][i * n + j]
            want = single["choices"][j]
            assert got["text"] == want["text"], (i, j)
            assert got["finish_reason"] == want["finish_reason"]
            assert got["logprobs"] is None
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["prompt_tokens"] == sum(len(engine.tokenize(p)) for p in PROMPTS)
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # streamed: the choices' chunks interleave, each with its index; the same texts and
    # finish reasons, and the usage chunk sums all of them
    got, chunks = await _stream(http, **kw, prompt=prompts, stream_options={"include_usage": True})
    assert sorted(got) == list(range(len(prompts) * n))
    for c in batch["choices"]:
        assert got[c["index"]]["text"] == c["text"]
        assert got[c["index"]]["finish"] == c["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    assert wait_until(lambda: _quiet(engine))


async def test_echo_and_lengths_per_prompt(http, engine):
    """Each choice echoes its own prompt; ignore_eos makes every choice run to max_tokens,
    so the usage is exact; max_tokens 0 with echo is each prompt alone (no engine work)."""
    kw = {"model": engine.model_name, "temperature": 0, "echo": True, "n": 2}
    r = await _post(http, **kw, prompt=PROMPTS, max_tokens=4, ignore_eos=True)
    assert len(r["choices"]) == 6
    for c in r["choices"]:
        assert c["text"].startswith(PROMPTS[c["index"] // 2])
        assert c["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 3 * 2 * 4
    zero = await _post(http, **kw, prompt=PROMPTS, max_tokens=0)
    assert [c["text"] for c in zero["choices"]] == [p for p in PROMPTS for _ in range(2)]
    assert zero["usage"]["completion_tokens"] == 0
    got, _ = await _stream(http, **kw, prompt=PROMPTS, max_tokens=0)
    assert [got[i]["text"] for i in range(6)] == [p for p in PROMPTS for _ in range(2)]


def _harness_loglikelihood(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-evaluation-harness's local-completions does with a loglikelihood answer:
    choices sorted by index, one per request; the continuation's logprob is the sum of
    token_logprobs[ctxlen:-1] (the last entry is the generated token), greedy when each
    of those is the largest of its top_logprobs."""
    out = []
    choices = sorted(response["choices"], key=itemgetter("index"))
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        lp = choice["logprobs"]
        cont = lp["token_logprobs"][ctxlen:-1]
        tops = lp["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(top.values()) for t, top in zip(cont, tops, strict=True))
        out.append((sum(cont), greedy))
    return out


async def test_lm_eval_loglikelihood_payload(http, engine, scores):
    """Three (context, continuation) pairs of different lengths as token id lists; one
    continuation is the model's own greedy one."""
    contexts = [engine.tokenize(p) for p in PROMPTS]
    greedy = await _post(
        http,
        model=engine.model_name,
        prompt=contexts[0],
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
    )
    continuations = [
        engine.tokenize(greedy["choices"][0]["text"]),
        engine.tokenize(" and then it flew"),
        engine.tokenize("!"),
    ]
    requests = [c + k for c, k in zip(contexts, continuations, strict=True)]
    assert len({len(r) for r in requests}) == 3
    payload = {
        "model": engine.model_name,
        "prompt": requests,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    batch = await _post(http, **payload)
    assert len(batch["choices"]) == 3
    results = _harness_loglikelihood(batch, [len(c) for c in contexts])
    for i, ids in enumerate(requests):
        choice = batch["choices"][i]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ids) + 1
        assert lp["tokens"][: len(ids)] == [engine.detokenize([t]) for t in ids]
        assert choice["text"].startswith(engine.detokenize(ids))
        # the prompt's entries are the single-prompt request's
        single = (await _post(http, **{**payload, "prompt": ids}))["choices"][0]["logprobs"]
        n = len(ids)
        assert lp["tokens"][:n] == single["tokens"][:n]
        assert lp["text_offset"][:n] == single["text_offset"][:n]
        assert lp["token_logprobs"][1:n] == pytest.approx(single["token_logprobs"][1:n], abs=ATOL)
        assert [list(t) for t in lp["top_logprobs"][1:n]] == [
            list(t) for t in single["top_logprobs"][1:n]
        ]
        # and the harness's numbers are transformers'
        ref = scores(ids)
        ctxlen = len(contexts[i])
        want = sum(float(ref[p - 1, ids[p]]) for p in range(ctxlen, n))
        want_greedy = all(int(ref[p - 1].argmax()) == ids[p] for p in range(ctxlen, n))
        assert results[i][0] == pytest.approx(want, abs=ATOL * n)
        assert results[i][1] == want_greedy
    assert results[0][1] is True  # the model's own continuation is greedy
    assert batch["usage"]["prompt_tokens"] == sum(len(r) for r in requests)
    assert batch["usage"]["completion_tokens"] <= 3
    # streamed: each choice's first chunk carries its own prompt's entries
    got, _ = await _stream(http, **payload)
    for c in batch["choices"]:
        g = got[c["index"]]
        assert g["text"] == c["text"]
        assert g["lp"]["tokens"] == c["logprobs"]["tokens"]
        assert g["lp"]["token_logprobs"][0] is None
        assert g["lp"]["token_logprobs"][1:] == pytest.approx(
            c["logprobs"]["token_logprobs"][1:], abs=ATOL
        )
    assert wait_until(lambda: _quiet(engine))


async def test_lm_eval_generation_payload_and_the_openai_client(http, engine):
    kw = {"model": engine.model_name, "max_tokens": 8, "temperature": 0, "seed": 1234}
    payload = {**kw, "prompt": PROMPTS[:2], "stop": ["\n\n", "Question:"]}
    batch = await _post(http, **payload)
    for i, p in enumerate(PROMPTS[:2]):
        single = await _post(http, **{**payload, "prompt": p})
        assert batch["choices"][i]["text"] == single["choices"][0]["text"]
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http)
    r = await client.completions.create(prompt=["a", "b"], n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        single = await client.completions.create(prompt=["a", "b"][c.index // 2], **kw)
        assert c.text == single.choices[0].text
    assert r.usage.prompt_tokens == len(engine.tokenize("a")) + len(engine.tokenize("b"))
    stream = await client.completions.create(prompt=["a", "b"], stream=True, **kw)
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [r.choices[0].text, r.choices[2].text]


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


async def test_bad_prompts_are_a_400_naming_them_before_any_engine_work(http, engine):
    model = engine.model_name
    before = engine.stats_now()
    cases = [
        ({"prompt": ["a", "b", ""]}, "prompt[2]: the prompt is empty", "prompt[2]"),
        ({"prompt": [[1, 2], [3, 10**7]]}, "prompt[1]: prompt token id 10000000", "prompt[1]"),
        ({"prompt": [[5], []]}, "prompt[1]: the prompt is empty", "prompt[1]"),
        ({"prompt": ["a", "parrot " * 600]}, "prompt[1]: This model's maximum", "prompt[1]"),
        ({"prompt": ["a", "b " * 200], "max_tokens": 400}, "prompt[1]: ", "max_tokens"),
        ({"prompt": []}, "prompt must not be an empty list", "prompt"),
    ]
    for body, message, param in cases:
        r = await http.post("/v1/completions", json={"model": model, **body})
        assert r.status_code == 400, body
        assert _error(r)["message"].startswith(message), _error(r)
        assert _error(r)["param"] == param
    too_long = await http.post(
        "/v1/completions", json={"model": model, "prompt": ["a", "parrot " * 600]}
    )
    assert _error(too_long)["code"] == "context_length_exceeded"
    # a lone surrogate (JSON can carry one) in the fourth prompt
    raw = json.dumps({"model": model, "prompt": ["a", "b", "c", "x\ud800"]})
    r = await http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and _error(r)["message"].startswith("prompt[3]: "), r.text
    assert "surrogate" in _error(r)["message"]
    after = engine.stats_now()
    assert after.tokens_computed == before.tokens_computed
    assert after.tokens_generated == before.tokens_generated
    assert _quiet(engine)
    # a list of one prompt is as one prompt: its errors are as they always were
    r = await http.post("/v1/completions", json={"model": model, "prompt": [""]})
    assert _error(r)["message"] == "the prompt is empty (zero tokens)"


async def test_prompts_per_request_are_capped(engine):
    async with engine:
        settings = ServerSettings(max_prompts=3)
        async with _http(create_app(engine, settings=settings)) as http:
            ok = await _post(http, model=engine.model_name, prompt=["a", "b", "c"], max_tokens=1)
            assert len(ok["choices"]) == 3
            r = await http.post(
                "/v1/completions",
                json={"model": engine.model_name, "prompt": ["a", "b", "c", "d"], "max_tokens": 1},
            )
            assert r.status_code == 400
            assert _error(r)["message"].startswith("at most 3 prompts are allowed")
            assert _error(r)["param"] == "prompt"
        # each prompt takes an in-flight slot: never more prompts than slots
        app = create_app(engine, settings=ServerSettings(max_inflight=2))
        async with _http(app) as http:
            r = await http.post(
                "/v1/completions",
                json={"model": engine.model_name, "prompt": ["a", "b", "c"], "max_tokens": 1},
            )
            assert r.status_code == 400 and "at most 2 prompts" in _error(r)["message"]
            ok = await _post(http, model=engine.model_name, prompt=["a", "b"], max_tokens=1)
            assert len(ok["choices"]) == 2
            assert app.state.parrot.limiter.inflight == 0
    assert engine.contexts == {}


def test_a_batch_takes_its_slots_all_at_once_or_none():
    limiter = InflightLimiter(4, retry_after_s=1)
    held = limiter.acquire_many(3)
    with pytest.raises(APIError) as err:
        limiter.acquire_many(2)
    assert err.value.status == 429 and "needs 2" in err.value.message
    assert limiter.inflight == 3  # nothing taken by the refused batch
    more = limiter.acquire_many(1)
    for slot in held + more:
        slot.release()
        slot.release()  # idempotent
    assert limiter.inflight == 0


class FailingEngine:
    """The real engine, except that the prompt starting with `poison` fails: in its fill
    (`where="fill"`) or after its first generated token (`where="generate"`)."""

    def __init__(self, engine, poison: int, where: str) -> None:
        self._engine = engine
        self._poison = poison
        self._where = where
        self._poisoned: set = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def fill(self, context_id, parent_id, tokens, **kw):
        if tokens and tokens[0] == self._poison:
            self._poisoned.add(context_id)
            if self._where == "fill":
                raise OutOfMemory("poisoned prompt")
        return await self._engine.fill(context_id, parent_id, tokens, **kw)

    async def generate(self, context_id, parent_id, sampling, **kw):
        it = self._engine.generate(context_id, parent_id, sampling, **kw)
        try:
            async for delta in it:
                yield delta
                if context_id in self._poisoned or parent_id in self._poisoned:
                    raise OutOfMemory("poisoned generation")
        finally:
            await it.aclose()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["fill", "generate"])
async def test_an_engine_failure_of_one_prompt_closes_every_run(engine, where, stream):
    poison = engine.tokenize("Zebra")[0]
    prompts = [engine.tokenize(p) for p in PROMPTS]
    prompts.insert(1, [poison, *engine.tokenize(" crossing")])
    body = {
        "model": engine.model_name,
        "max_tokens": 50,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "stream": stream,
    }
    async with engine:
        app = create_app(FailingEngine(engine, poison, where), settings=ServerSettings())
        async with _http(app) as http:
            single = await http.post("/v1/completions", json={**body, "prompt": prompts[1]})
            batch = await http.post("/v1/completions", json={**body, "prompt": prompts})
            assert wait_until(lambda: _quiet(engine))
            assert app.state.parrot.limiter.inflight == 0
            if not stream or where == "fill":  # an HTTP status, as for the prompt alone
                assert single.status_code == batch.status_code == 400
                assert single.json() == batch.json()
                assert batch.json()["error"]["code"] == "kv_cache_full"
            else:  # after the headers: the error payload, as for the prompt alone
                assert single.status_code == batch.status_code == 200
                errors = [
                    json.loads(line[6:])
                    for line in (single.text, batch.text)
                    for line in line.splitlines()
                    if line.startswith('data: {"error"')
                ]
                assert len(errors) == 2 and errors[0] == errors[1]
                assert batch.text.rstrip().endswith("data: [DONE]")
            ok = await _post(http, **{**body, "stream": False, "prompt": prompts[::2]})
            assert len(ok["choices"]) == 4
    assert engine.contexts == {}


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_of_a_batch_closes_every_run(tiny_model_dir, stream):
    from parrot_backend.engine.engine import Engine

    engine = Engine.from_pretrained(
        tiny_model_dir, num_blocks=256, progress=False, device="cpu", dtype="float32"
    )
    app = create_app(engine, settings=ServerSettings(manage_engine=True))
    body = {
        "model": engine.model_name,
        "prompt": ["a", "b c", "d e f"],
        "n": 2,
        "max_tokens": 500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    with LiveServer(app) as live:
        if stream:
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                seen = set()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                    if len(seen) >= 4:  # choices of several prompts under way
                        break
        else:  # send it, wait until its choices generate, hang up
            before = engine.stats_now().tokens_generated
            raw = json.dumps(body).encode()
            with socket.create_connection(("127.0.0.1", live.port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw
                )
                assert wait_until(
                    lambda: engine.stats_now().tokens_generated > before + 12, timeout=30
                )
        assert wait_until(lambda: _quiet(engine))
        generated = engine.stats_now().tokens_generated
        assert generated < 6 * 500  # stopped far short of what the batch asked for
        assert wait_until(lambda: app.state.parrot.limiter.inflight == 0)
        assert app.state.parrot.metrics.requests_running._value.get() == 0
        assert engine.stats_now().tokens_generated == generated  # decoding stopped
    assert engine._task is None
