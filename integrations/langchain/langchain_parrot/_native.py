"""The native API as `compile_chain` uses it: create a run and read its event stream in
one request, add calls and inputs to it, and wait for semantic variables.

A `RunSession` holds one run of the server. It gathers calls and inputs until the chain
being run needs a value back (or is done), then sends them in one request: the first
creates the run with `POST /v1/runs?stream=true`, whose answer is the run's event stream,
read in the background for the rest of the session; later ones add calls and inputs to
the same run (`POST /v1/runs/{id}/calls`), closing it with the last.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from ._http import (
    Endpoint,
    _transport_error,
    aiter_sse_lines,
    error_from_response,
    retry_delay,
)
from .errors import ParrotError, ParrotResponseError

RETRY = frozenset({429, 502, 503, 504})
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# an input placeholder not escaped (an even run of backslashes before it)
_INPUT = re.compile(r"(\\*)\{\{input:([A-Za-z_][A-Za-z0-9_.-]*)\}\}")

EventHook = Callable[[str, dict[str, Any]], Awaitable[None] | None]


class RunFailed(ParrotError):
    """A semantic variable will never get a value: its call (or one upstream) failed, or
    the run was cancelled or ended without it."""


class RunSession:
    """One native run fed incrementally by a client; see the module doc."""

    def __init__(
        self, client: httpx.AsyncClient, endpoint: Endpoint, *, on_event: EventHook | None = None
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.on_event = on_event
        self.run_id: str | None = None
        self.calls: list[dict[str, Any]] = []  # gathered, not sent yet
        self.inputs: dict[str, str] = {}
        self.outputs: dict[str, str] = {}  # criteria of awaited outputs, sent with the run
        self.values: dict[str, str] = {}  # every value known: inputs and committed outputs
        self.requests = 0  # HTTP requests sent (tests and plan() count them)
        self.closed = False
        self._referenced: set[str] = set()  # inputs the calls sent or gathered read
        self._outputs_of: dict[str, list[str]] = {}  # call -> the variables it generates
        self.failed: dict[str, RunFailed] = {}  # variables that will never get a value
        self._waiters: dict[str, list[asyncio.Future[str]]] = {}
        self._stream: asyncio.Task[None] | None = None
        self._ended: BaseException | None = None

    # ------------------------------------------------------------------ building
    def add_input(self, name: str, value: str) -> None:
        """A value the client knows (a chain input, a client step's output)."""
        self.inputs[name] = value
        self.values[name] = value

    def add_call(self, call: dict[str, Any]) -> None:
        self.calls.append(call)
        self._outputs_of[call["name"]] = list(call.get("outputs", ()))
        texts = [call.get("template") or ""] + [m["content"] for m in call.get("messages", ())]
        for text in texts:
            for m in _INPUT.finditer(text):
                if len(m.group(1)) % 2 == 0:
                    self._referenced.add(m.group(2))

    def _inputs_to_send(self) -> dict[str, str]:
        """Gathered inputs some call reads (a closed run takes no others); the rest wait."""
        send = {k: v for k, v in self.inputs.items() if k in self._referenced}
        self.inputs = {k: v for k, v in self.inputs.items() if k not in send}
        return send

    @property
    def dirty(self) -> bool:
        """Whether calls, or inputs a call reads, wait to be sent."""
        return bool(self.calls) or any(k in self._referenced for k in self.inputs)

    # ------------------------------------------------------------------ sending
    async def flush(self, *, close: bool) -> None:
        """Send what is gathered (creating the run on the first flush); `close`: no more
        calls or inputs will come."""
        if self.closed:
            return
        if self.run_id is None:
            if not self.calls:
                raise ParrotResponseError("a run needs at least one call")
            body = {
                "program": {"calls": self.calls},
                "inputs": self._inputs_to_send(),
                "outputs": dict(self.outputs),
                "open": not close,
            }
            self.calls = []
            response = await self._send("/v1/runs?stream=true", body, stream=True)
            self.run_id = response.headers.get("x-parrot-run-id")
            if not self.run_id:
                await response.aclose()
                raise ParrotResponseError("the server did not name the run it created")
            self._stream = asyncio.create_task(self._read(response))
        else:
            body = {"calls": self.calls, "inputs": self._inputs_to_send(), "close": close}
            self.calls = []
            response = await self._send(f"/v1/runs/{self.run_id}/calls", body, stream=False)
            await response.aclose()
        self.closed = close

    async def _send(self, path: str, body: dict, *, stream: bool) -> httpx.Response:
        ep = self.endpoint
        url = ep.url(path)
        attempt = 0
        while True:
            request = self.client.build_request(
                "POST", url, json=body, headers=ep.headers(stream), timeout=ep.timeout
            )
            self.requests += 1
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError as exc:
                # retried only when no byte reached the server: a run created or calls
                # added twice would run twice (a dropped keep-alive connection, which the
                # request-level routes retry too, may have delivered the request)
                if attempt >= ep.max_retries or not isinstance(exc, _UNSENT):
                    raise _transport_error(exc, ep, url) from exc
                await asyncio.sleep(retry_delay(None, attempt))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            if response.status_code in RETRY and attempt < ep.max_retries:
                await response.aclose()
                await asyncio.sleep(retry_delay(response, attempt))
                attempt += 1
                continue
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise error_from_response(response)

    # ------------------------------------------------------------------ receiving
    async def value(self, name: str) -> str:
        """The value of a variable, once the server committed it."""
        if name in self.values:
            return self.values[name]
        if name in self.failed:
            raise self.failed[name]
        if self._ended is not None:
            raise self._ended
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(name, []).append(fut)
        return await fut

    async def _read(self, response: httpx.Response) -> None:
        """Dispatch the run's events until `run_finished` (or the stream breaks)."""
        kind, data = "message", []
        try:
            async for line in aiter_sse_lines(response):
                if line == "":
                    if data:
                        await self._event(kind, _payload(kind, "\n".join(data)))
                    kind, data = "message", []
                elif line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            self._end(RunFailed(f"run {self.run_id}: the event stream ended early"))
        except httpx.HTTPError as exc:
            self._end(_transport_error(exc, self.endpoint, self.endpoint.url("/v1/runs")))
        except BaseException as exc:
            self._end(exc if isinstance(exc, Exception) else RunFailed("stream cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            await response.aclose()

    async def _event(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "variable_ready":
            name, value = payload["name"], payload["value"]
            self.values[name] = value
            for fut in self._waiters.pop(name, []):
                if not fut.done():
                    fut.set_result(value)
        elif kind == "variable_failed":
            self._fail(
                payload["name"],
                RunFailed(f"variable {payload['name']!r} failed: {payload.get('error')}"),
            )
        elif kind == "call_failed":
            # the server's reason, for each output of the call (its stream does not always
            # carry a `variable_failed` for them)
            call = payload.get("call")
            for name in self._outputs_of.get(call, ()):
                self._fail(name, RunFailed(f"call {call!r} failed: {payload.get('error')}"))
        if self.on_event is not None:
            done = self.on_event(kind, payload)
            if done is not None:
                await done
        if kind == "run_finished":
            status = payload.get("status")
            self._end(RunFailed(f"run {self.run_id} ended ({status}) before the value came"))

    def _fail(self, name: str, error: RunFailed) -> None:
        if name in self.values or name in self.failed:
            return
        self.failed[name] = error
        for fut in self._waiters.pop(name, []):
            if not fut.done():
                fut.set_exception(error)

    def _end(self, error: BaseException) -> None:
        if self._ended is None:
            self._ended = error
        for futs in self._waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(error)
        self._waiters.clear()

    async def finish(self) -> None:
        """Wait for the run's end (its stream), after the last flush closed it."""
        if self._stream is not None:
            await asyncio.shield(self._stream)

    async def abort(self) -> None:
        """Stop reading and cancel the run on the server (the caller gave up)."""
        running = self.run_id is not None and self._ended is None
        if self._stream is not None and not self._stream.done():
            self._stream.cancel()
        if running:
            try:
                url = self.endpoint.url(f"/v1/runs/{self.run_id}/cancel")
                await self.client.post(
                    url, headers=self.endpoint.headers(False), timeout=self.endpoint.timeout
                )
            except httpx.HTTPError:
                pass  # the server may be gone: nothing more to stop


def _payload(kind: str, data: str) -> dict[str, Any]:
    """An event's JSON payload; a `ParrotResponseError` when it is not a JSON object."""
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise ParrotResponseError(f"a {kind!r} event is not a JSON object: {data[:200]!r}")
    return payload
