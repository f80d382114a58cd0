"""A scripted upstream on an httpx MockTransport: llama.cpp's routes or plain OpenAI ones.

Text is one token per character (`ord`), so prompts and answers are easy to read in
assertions. Generation follows `script(prompt) -> token ids`; the default answers the
characters "abcdef..." up to `n_predict`/`max_tokens`. `$` is the EOS token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx

EOS = "$"


class CharTokenizer:
    """What `LocalTokenizer` needs of a Hugging Face tokenizer, one token per character."""

    all_special_ids: list[int] = []
    all_special_tokens: list[str] = []
    eos_token_id = ord(EOS)
    eos_token = EOS
    bos_token = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == ord(EOS)))

    def __len__(self) -> int:
        return 256


def default_script(prompt: list[int], n: int) -> list[int]:
    return [ord("a") + i % 26 for i in range(n)]


class _Stream(httpx.AsyncByteStream):
    """A streamed body that records whether the client closed it before its end."""

    def __init__(self, upstream: FakeUpstream, events: list[bytes], delay: float) -> None:
        self.upstream, self.events, self.delay = upstream, events, delay
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.sent += 1
            yield event

    async def aclose(self) -> None:
        if self.sent < len(self.events):
            self.upstream.cancelled += 1


class FakeUpstream:
    """Routes of one server; `requests` records (path, body) of every generation request."""

    def __init__(self, kind: str = "llama.cpp", *, n_ctx: int = 512, slots: int = 2) -> None:
        self.kind = kind
        self.n_ctx = n_ctx
        self.slots = slots
        self.requests: list[tuple[str, dict]] = []
        self.script: Callable[[list[int], int], list[int]] = default_script
        self.fail: dict[str, list[int]] = {}  # path -> statuses to answer first, in order
        self.cut_after: int | None = None  # end streams after this many events, no finish
        self.delay = 0.0  # seconds between streamed events
        self.warm_gate: asyncio.Event | None = None  # warm-ups wait for it when set
        self.cancelled = 0
        self.down = False
        self.metrics = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 3\n"

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def sync_transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle_sync)

    # ------------------------------------------------------------------ routes
    def handle_sync(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"tokens": [ord(c) for c in body["content"]]})
        if request.url.path == "/detokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"content": "".join(map(chr, body["tokens"]))})
        return httpx.Response(404)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        queued = self.fail.get(path)
        if queued:
            status = queued.pop(0)
            return httpx.Response(
                status,
                json={"error": {"code": status, "message": "scripted"}},
                headers={"retry-after": "0.01"},
            )
        if path == "/v1/models":
            owner = "llamacpp" if self.kind == "llama.cpp" else "parrot"
            card = {"id": "fake-model", "owned_by": owner, "meta": {"n_vocab": 256}}
            if self.kind != "llama.cpp":
                card["max_model_len"] = self.n_ctx
            return httpx.Response(200, json={"data": [card]})
        if path == "/props" and self.kind == "llama.cpp":
            return httpx.Response(
                200,
                json={
                    "default_generation_settings": {"n_ctx": self.n_ctx},
                    "total_slots": self.slots,
                    "eos_token": EOS,
                },
            )
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if path in ("/tokenize", "/detokenize"):
            return self.handle_sync(request)
        if path == "/completion" and self.kind == "llama.cpp":
            return await self._llama(json.loads(request.content))
        if path == "/v1/completions" and self.kind != "llama.cpp":
            return self._openai(json.loads(request.content))
        return httpx.Response(404, json={"error": {"message": "no route"}})

    async def _llama(self, body: dict) -> httpx.Response:
        self.requests.append(("/completion", body))
        prompt = body["prompt"]
        if not body.get("stream"):  # a warm-up
            if self.warm_gate is not None:
                await self.warm_gate.wait()
            return httpx.Response(
                200,
                json={
                    "content": "",
                    "tokens": [],
                    "stop": True,
                    "timings": {"prompt_n": len(prompt), "cache_n": 0},
                },
            )
        events, stop_type = [], "limit"
        for t in self.script(prompt, body["n_predict"]):
            events.append(
                {"content": chr(t) if chr(t) != EOS else "", "tokens": [t], "stop": False}
            )
            if chr(t) == EOS and not body.get("ignore_eos"):
                stop_type = "eos"
                break
        events.append(
            {
                "content": "",
                "tokens": [],
                "stop": True,
                "stop_type": stop_type,
                "timings": {"prompt_n": len(prompt) - 2, "cache_n": 2},
            }
        )
        return self._sse(events, done=False)

    def _openai(self, body: dict) -> httpx.Response:
        self.requests.append(("/v1/completions", body))
        prompt = body["prompt"]
        ids = self.script(prompt, body["max_tokens"])
        if not body.get("stream"):
            text = "".join(map(chr, ids))
            return httpx.Response(
                200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
            )
        events = [{"choices": [{"index": 0, "text": chr(t), "finish_reason": None}]} for t in ids]
        events[-1]["choices"][0]["finish_reason"] = "length"
        events.append(
            {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
        )
        return self._sse(events, done=True)

    def _sse(self, events: list[dict], done: bool) -> httpx.Response:
        frames = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
        if done:
            frames.append(b"data: [DONE]\n\n")
        if self.cut_after is not None:
            frames = frames[: self.cut_after]
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_Stream(self, frames, self.delay),
        )
