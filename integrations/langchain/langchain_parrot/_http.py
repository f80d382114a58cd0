"""HTTP to a parrot-backend server: auth, retries with backoff, error mapping, SSE.

One POST helper and one stream helper, each sync and async. What is retried: 429 and
502/503/504 (honouring `Retry-After`), and failures where the request cannot have reached
the server (connect errors and timeouts, a keep-alive connection the server had closed).
A read timeout is not retried: the server may still be generating, and `timeout` is the
caller's bound on waiting.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from .errors import (
    ParrotAPIError,
    ParrotAuthenticationError,
    ParrotBadRequestError,
    ParrotConnectionError,
    ParrotError,
    ParrotRateLimitError,
    ParrotResponseError,
    ParrotServerError,
    ParrotTimeoutError,
)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is capped: the caller would rather fail
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError)
_BY_TYPE = {
    "authentication_error": ParrotAuthenticationError,
    "permission_error": ParrotAuthenticationError,
    "rate_limit_error": ParrotRateLimitError,
    "invalid_request_error": ParrotBadRequestError,
    "not_found_error": ParrotBadRequestError,
}


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send: the server root, the key, the time bound, the retries."""

    base_url: str
    api_key: str | None
    timeout: float | None
    max_retries: int

    def url(self, path: str) -> str:
        """The full URL of an API path such as `/v1/chat/completions`."""
        root = self.base_url.rstrip("/")
        root = root.removesuffix("/v1")  # accept the OpenAI habit of a base URL ending in /v1
        return root + path

    def headers(self, stream: bool) -> dict[str, str]:
        """Request headers: JSON or SSE, and the Bearer key when there is one."""
        headers = {"Accept": "text/event-stream" if stream else "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def retry_delay(response: httpx.Response | None, attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0-based).

    The server's `Retry-After` (seconds or an HTTP date) when it sent one, capped at
    MAX_RETRY_AFTER_S; otherwise exponential backoff from 0.5 s (cap 8 s) with jitter.
    """
    header = response.headers.get("retry-after") if response is not None else None
    if header:
        seconds = _retry_after_seconds(header.strip())
        if seconds is not None:
            return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
    return min(0.5 * 2**attempt, 8.0) * random.uniform(0.5, 1.0)


def _retry_after_seconds(value: str) -> float | None:
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return seconds if math.isfinite(seconds) else None


def error_from_response(response: httpx.Response) -> ParrotAPIError:
    """The exception for an error status, carrying the server's message when it sent one."""
    status = response.status_code
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    fields = _error_fields(body)
    if fields is None:
        text = response.text.strip()[:500]
        fields = {"message": text or response.reason_phrase or "no message"}
    if status in (401, 403):
        cls: type[ParrotAPIError] = ParrotAuthenticationError
    elif status == 429:
        cls = ParrotRateLimitError
    elif status >= 500:
        cls = ParrotServerError
    else:
        cls = ParrotBadRequestError
    return cls(status_code=status, **fields)


def error_from_payload(payload: dict) -> ParrotAPIError:
    """The exception for an `{"error": ...}` payload inside a stream."""
    fields = _error_fields(payload) or {"message": "the server reported an unreadable error"}
    cls = _BY_TYPE.get(fields.get("type") or "", ParrotServerError)
    return cls(**fields)


def _error_fields(body: Any) -> dict[str, Any] | None:
    """message/type/param/code of an OpenAI-shaped error body; None if it is not one."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, str):
        return {"message": error}
    if not isinstance(error, dict):
        return None
    fields: dict[str, Any] = {"message": str(error.get("message") or "no message")}
    for key in ("type", "param", "code"):
        value = error.get(key)
        fields[key] = None if value is None else str(value)
    return fields


def _transport_error(exc: httpx.HTTPError, endpoint: Endpoint, url: str) -> ParrotError:
    if isinstance(exc, httpx.TimeoutException):
        return ParrotTimeoutError(
            f"no answer from {url} within {endpoint.timeout} s "
            f"({type(exc).__name__}); raise `timeout` for long outputs"
        )
    return ParrotConnectionError(f"cannot reach {url}: {type(exc).__name__}: {exc}")


_DONE = object()
_EOL = re.compile("\r\n|\r|\n")


class SSELines:
    """Splits a stream's text into SSE lines, ended by CRLF, LF or CR only: unlike
    httpx's `iter_lines` (Python's `splitlines`), never at U+2028, U+0085 or another
    Unicode separator, which the server sends raw inside JSON strings."""

    def __init__(self) -> None:
        self._rest = ""
        self._after_cr = False  # the last piece ended with CR: a LF next belongs to it

    def feed(self, text: str) -> list[str]:
        """The lines `text` completes."""
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        if not text:
            return []
        self._after_cr = text.endswith("\r")
        lines = _EOL.split(self._rest + text)
        self._rest = lines.pop()
        return lines

    def end(self) -> list[str]:
        """The last line, if the stream did not end it."""
        rest, self._rest = self._rest, ""
        return [rest] if rest else []


def iter_sse_lines(response: httpx.Response) -> Iterator[str]:
    """The SSE lines of a streamed response."""
    lines = SSELines()
    for text in response.iter_text():
        yield from lines.feed(text)
    yield from lines.end()


async def aiter_sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The SSE lines of a streamed response (async)."""
    lines = SSELines()
    async for text in response.aiter_text():
        for line in lines.feed(text):
            yield line
    for line in lines.end():
        yield line


def _decode_line(line: str) -> object:
    """One SSE line: a payload dict, _DONE, or None (comments, blank lines, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        raise ParrotResponseError(f"a stream chunk is not JSON: {data[:200]!r}") from None
    if not isinstance(payload, dict):
        raise ParrotResponseError(f"a stream chunk is not a JSON object: {data[:200]!r}")
    if "error" in payload:
        raise error_from_payload(payload)
    return payload


_NO_DONE = "the stream ended before `data: [DONE]` (the server or the connection failed)"


class SyncTransport:
    """Blocking requests through one httpx.Client (thread-safe, keeps connections alive)."""

    def __init__(self, client: httpx.Client, endpoint: Endpoint) -> None:
        self.client = client
        self.endpoint = endpoint

    def post(self, path: str, payload: dict) -> Any:
        """POST JSON and return the decoded JSON answer."""
        response = self._send(path, payload, stream=False)
        try:
            return response.json()
        except ValueError:
            raise ParrotResponseError(
                f"the answer of {path} is not JSON: {response.text[:200]!r}"
            ) from None

    def stream(self, path: str, payload: dict) -> Iterator[dict]:
        """POST with `stream: true` and yield each SSE payload until `[DONE]`.

        Closing the iterator early closes the connection, which stops the generation.
        """
        url = self.endpoint.url(path)
        response = self._send(path, payload, stream=True)
        try:
            for line in iter_sse_lines(response):
                item = _decode_line(line)
                if item is _DONE:
                    return
                if item is not None:
                    yield item  # type: ignore[misc]
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.endpoint, url) from exc
        finally:
            response.close()
        raise ParrotResponseError(_NO_DONE)

    def _send(self, path: str, payload: dict, *, stream: bool) -> httpx.Response:
        ep = self.endpoint
        url = ep.url(path)
        attempt = 0
        while True:
            request = self.client.build_request(
                "POST", url, json=payload, headers=ep.headers(stream), timeout=ep.timeout
            )
            try:
                response = self.client.send(request, stream=stream)
            except httpx.HTTPError as exc:
                if attempt >= ep.max_retries or not isinstance(exc, _NOT_SENT):
                    raise _transport_error(exc, ep, url) from exc
                time.sleep(retry_delay(None, attempt))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            if response.status_code in RETRY_STATUSES and attempt < ep.max_retries:
                response.close()
                time.sleep(retry_delay(response, attempt))
                attempt += 1
                continue
            try:
                response.read()
            finally:
                response.close()
            raise error_from_response(response)


class AsyncTransport:
    """The same over one httpx.AsyncClient, used within one event loop."""

    def __init__(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        self.client = client
        self.endpoint = endpoint

    async def post(self, path: str, payload: dict) -> Any:
        """POST JSON and return the decoded JSON answer."""
        response = await self._send(path, payload, stream=False)
        try:
            return response.json()
        except ValueError:
            raise ParrotResponseError(
                f"the answer of {path} is not JSON: {response.text[:200]!r}"
            ) from None

    async def stream(self, path: str, payload: dict) -> AsyncIterator[dict]:
        """POST with `stream: true` and yield each SSE payload until `[DONE]`."""
        url = self.endpoint.url(path)
        response = await self._send(path, payload, stream=True)
        try:
            async for line in aiter_sse_lines(response):
                item = _decode_line(line)
                if item is _DONE:
                    return
                if item is not None:
                    yield item  # type: ignore[misc]
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.endpoint, url) from exc
        finally:
            await response.aclose()
        raise ParrotResponseError(_NO_DONE)

    async def _send(self, path: str, payload: dict, *, stream: bool) -> httpx.Response:
        ep = self.endpoint
        url = ep.url(path)
        attempt = 0
        while True:
            request = self.client.build_request(
                "POST", url, json=payload, headers=ep.headers(stream), timeout=ep.timeout
            )
            try:
                response = await self.client.send(request, stream=stream)
            except httpx.HTTPError as exc:
                if attempt >= ep.max_retries or not isinstance(exc, _NOT_SENT):
                    raise _transport_error(exc, ep, url) from exc
                await asyncio.sleep(retry_delay(None, attempt))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            if response.status_code in RETRY_STATUSES and attempt < ep.max_retries:
                await response.aclose()
                await asyncio.sleep(retry_delay(response, attempt))
                attempt += 1
                continue
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise error_from_response(response)
