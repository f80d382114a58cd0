"""A scripted OpenAI-compatible server behind httpx.MockTransport: no sockets."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def chat_body(text: str = "Hi there", finish: str = "stop") -> dict[str, Any]:
    """A whole chat completion."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": USAGE,
    }


def completion_body(*texts: str) -> dict[str, Any]:
    """A whole text completion, one choice per text."""
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": "length"}
            for i, t in enumerate(texts)
        ],
        "usage": USAGE,
    }


def sse(*payloads: Any, done: bool = True) -> bytes:
    """An SSE body of `data:` frames (dicts as JSON, strings as they are) and `[DONE]`."""
    frames = [": ping\n\n"]
    for p in payloads:
        frames.append(f"data: {p if isinstance(p, str) else json.dumps(p, ensure_ascii=False)}\n\n")
    if done:
        frames.append("data: [DONE]\n\n")
    return "".join(frames).encode()


def chat_stream(*pieces: str, finish: str = "stop") -> bytes:
    """A chat stream as the server sends it: role first, text, finish, usage, [DONE]."""

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    payloads = [chunk({"role": "assistant", "content": ""})]
    payloads += [chunk({"content": p}) for p in pieces]
    payloads.append(chunk({}, finish))
    payloads.append(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": USAGE,
        }
    )
    return sse(*payloads)


def completion_stream(*pieces: str) -> bytes:
    """A completions stream: text chunks, the finish chunk, usage, [DONE]."""

    def chunk(text: str, finish_reason: str | None = None) -> dict:
        return {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    payloads = [chunk(p) for p in pieces] + [chunk("", "stop")]
    payloads.append(
        {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": USAGE,
        }
    )
    return sse(*payloads)


class FakeServer:
    """Answers each request with the next scripted reply and records the requests.

    A reply is an httpx.Response, an exception to raise, or a callable of the request.
    The last reply repeats once the script runs out.
    """

    def __init__(self, *replies: httpx.Response | Exception | Callable) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        if isinstance(reply, Exception):
            raise reply
        if callable(reply) and not isinstance(reply, httpx.Response):
            return reply(request)
        return reply

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def clients(self) -> dict[str, Any]:
        """`http_client` and `http_async_client` keyword arguments that talk to this fake."""
        transport = httpx.MockTransport(self)
        return {
            "http_client": httpx.Client(transport=transport),
            "http_async_client": httpx.AsyncClient(transport=transport),
        }


def ok(body: dict) -> httpx.Response:
    """200 with a JSON body."""
    return httpx.Response(200, json=body)


def stream(body: bytes) -> httpx.Response:
    """200 with an SSE body."""
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def error(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
) -> httpx.Response:
    """An OpenAI-shaped error answer."""
    body = {"error": {"message": message, "type": type, "param": param, "code": None}}
    return httpx.Response(status, json=body, headers=headers)


class NativeServer:
    """A scripted parrot-backend for `compile_chain`: `GET /v1/models`, `POST /v1/runs`
    (answered with the whole run's event stream, as the real server's `?stream=true`),
    `POST /v1/runs/{id}/cancel`, and `/v1/chat/completions` for steps run on the client.

    Every call whose inputs are known runs: its output is `gen(<its rendered inputs>)`,
    streamed as two tokens; a call whose inputs hold "FAIL" fails with a context-length
    reason, reported as the real server reports it (`call_failed`, no `variable_failed`);
    a run whose inputs hold "REFUSE" is refused as a whole (400), as a server that checks
    the prompts' lengths up front does.
    `delay`: seconds between events (the body is then an async stream).
    """

    RUN_ID = "run1"
    FAILURE = "InvalidRequest: context would hold 9031 tokens, more than the model's 8192"
    REFUSAL = "call 'c3' needs at least 9032 tokens of context; the model's context holds 8192"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests: list[httpx.Request] = []

    @property
    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/models":
            return ok({"data": [{"id": MODEL, "max_model_len": 8192}]})
        if path == "/v1/chat/completions":
            last = json.loads(request.content)["messages"][-1]["content"]
            return ok(chat_body(f"chat({last})"))
        if path == f"/v1/runs/{self.RUN_ID}/cancel":
            return ok({"run_id": self.RUN_ID, "status": "cancelled"})
        if path == "/v1/runs":
            body = json.loads(request.content)
            if any("REFUSE" in v for v in body["inputs"].values()):
                return error(400, self.REFUSAL, param="program")
            events = self._run(body["program"]["calls"], dict(body["inputs"]))
            frames = [
                f"id: {i}\nevent: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
                for i, (kind, data) in enumerate(events, 1)
            ]
            headers = {"content-type": "text/event-stream", "x-parrot-run-id": self.RUN_ID}
            if not self.delay:
                return httpx.Response(200, content=b"".join(frames), headers=headers)
            return httpx.Response(200, content=self._slowly(frames), headers=headers)
        return error(404, f"no route {path}", type="not_found_error")

    async def _slowly(self, frames: list[bytes]):
        import asyncio

        for frame in frames:
            await asyncio.sleep(self.delay)
            yield frame

    def _run(self, calls: list[dict], values: dict[str, str]) -> list[tuple[str, dict]]:
        import re

        events: list[tuple[str, dict]] = [("run_created", {})]
        pending = list(calls)
        failed = False
        while pending:
            ready = []
            for call in pending:
                texts = [call.get("template", "")]
                texts += [m["content"] for m in call.get("messages", [])]
                names = [n for t in texts for n in re.findall(r"\{\{input:([^}]+)\}\}", t)]
                if all(n in values for n in names):
                    ready.append((call, [values[n] for n in names]))
            if not ready:
                break
            for call, given in ready:
                pending.remove(call)
                [out] = call["outputs"]
                events.append(("call_started", {"call": call["name"]}))
                if any("FAIL" in g for g in given):
                    events.append(("call_failed", {"call": call["name"], "error": self.FAILURE}))
                    failed = True
                    continue
                value = f"gen({'|'.join(given)})"
                values[out] = value
                half = len(value) // 2
                for piece in (value[:half], value[half:]):
                    token = {"call": call["name"], "variable": out, "text": piece}
                    events.append(("token", token))
                events.append(("variable_ready", {"name": out, "value": value}))
                done = {
                    "call": call["name"],
                    "prompt_tokens": 5,
                    "completion_tokens": 2,
                    "finish_reasons": {out: "stop"},
                }
                events.append(("call_finished", done))
        events.append(("run_finished", {"status": "failed" if failed else "finished"}))
        return events
