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
