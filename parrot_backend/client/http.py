"""`HttpBackend`: the SDK over a parrot-backend server's native API.

    from parrot_backend.client import HttpBackend, semantic_function, set_backend
    set_backend(HttpBackend("http://127.0.0.1:8000", api_key=None))

It keeps an event loop on a thread of its own, so plain synchronous programs can call
`var.get()`; async programs `await var.aget()` from any loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from parrot_backend.program import CallSpec, Criterion, RunSpec

LONG_POLL_S = 60.0  # one long-poll; a 408 means "not yet": ask again


class ServerError(RuntimeError):
    """The server refused a request; `status` and the server's `message` say why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class HttpBackend:
    """A `Backend` for a remote server: one open run per session, values long-polled."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout_s: float = 30.0
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="parrot-http-backend", daemon=True
        )
        self._thread.start()

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, trust_env=False
            )

        self._http = asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._http.aclose(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    async def _send(self, method: str, path: str, **kwargs: Any) -> dict:
        r = await self._http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ServerError(r.status_code, message)
        return r.json()

    async def create_run(self, spec: RunSpec) -> str:
        body = spec.model_dump(mode="json", exclude_none=True)
        return (await self._send("POST", "/v1/runs", json=body))["run_id"]

    async def add_calls(
        self, run_id: str, calls: list[CallSpec], waits: dict[str, Criterion] | None = None
    ) -> None:
        body: dict = {"calls": [c.model_dump(mode="json", exclude_none=True) for c in calls]}
        if waits:
            body["outputs"] = dict(waits)
        await self._send("POST", f"/v1/runs/{run_id}/calls", json=body)

    async def set_input(self, run_id: str, name: str, value: str) -> None:
        await self._send("PUT", f"/v1/runs/{run_id}/variables/{name}", json={"value": value})

    async def get(self, run_id: str, name: str, perf: Criterion) -> str:
        while True:
            try:
                view = await self._send(
                    "GET",
                    f"/v1/runs/{run_id}/variables/{name}",
                    params={"perf": perf, "timeout": LONG_POLL_S},
                    timeout=LONG_POLL_S + 10,
                )
            except ServerError as exc:
                if exc.status == 408:
                    continue  # not ready yet: the run goes on
                raise
            if view["status"] == "ready":
                return view["value"]
            raise ServerError(409, f"variable {name!r} failed: {view.get('error')}")

    async def close_run(self, run_id: str) -> None:
        await self._send("POST", f"/v1/runs/{run_id}/close")
