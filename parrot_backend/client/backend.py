"""Where the SDK sends programs: the `Backend` protocol and the in-process backend.

A backend runs a session's program as one open run: it creates the run, adds calls and
input values as the client builds more, and waits for variables. Every backend lives on
one event loop (`loop`); the SDK runs its coroutines there (`run_sync` from plain code,
`run_async` from any event loop). An HTTP backend implements the same five coroutines
against the server's native API.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from parrot_backend.program import CallSpec, Criterion, RunSpec

if TYPE_CHECKING:  # the SDK must import without torch (an HTTP client needs no engine)
    from parrot_backend.contract.engine import EngineClient

T = TypeVar("T")


@runtime_checkable
class Backend(Protocol):
    """What the SDK needs from a backend."""

    loop: asyncio.AbstractEventLoop

    async def create_run(self, spec: RunSpec) -> str: ...

    async def add_calls(
        self, run_id: str, calls: list[CallSpec], waits: dict[str, Criterion] | None = None
    ) -> None: ...

    async def set_input(self, run_id: str, name: str, value: str) -> None: ...

    async def get(self, run_id: str, name: str, perf: Criterion) -> str: ...

    async def close_run(self, run_id: str) -> None: ...


def run_sync(backend: Backend, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the backend's loop from synchronous code and return its result."""
    if _on_loop(backend.loop):
        coro.close()
        raise RuntimeError(
            "get() would block the event loop the backend runs on; use `await var.aget()`"
        )
    return asyncio.run_coroutine_threadsafe(coro, backend.loop).result()


async def run_async(backend: Backend, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` on the backend's loop from any event loop."""
    if _on_loop(backend.loop):
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, backend.loop))


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class InProcessBackend:
    """A backend over a `Manager` in this process.

    Build it inside the manager's loop (`InProcessBackend(manager)`), or let it host the
    engines and the manager on a thread of its own (`InProcessBackend.threaded(...)`), which
    plain synchronous programs need; `close()` stops that thread, as leaving a `with`
    block over the backend does (a thread left running is stopped mid-task at exit, and
    Python then reports its tasks as destroyed while pending).
    """

    def __init__(self, manager: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.manager = manager
        self.loop = loop or asyncio.get_running_loop()
        self._thread: threading.Thread | None = None
        self._engines: Mapping[str, EngineClient] = {}

    @classmethod
    def threaded(
        cls,
        make_engines: Callable[[], Mapping[str, EngineClient]],
        **manager_kwargs: Any,
    ) -> InProcessBackend:
        """Start a loop thread, build and start the engines (those with `start()`) and a
        `Manager` on it, and return a backend for it."""
        from parrot_backend.manager.manager import Manager

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="parrot-backend", daemon=True)
        thread.start()

        async def boot() -> InProcessBackend:
            engines = make_engines()
            for engine in engines.values():
                if hasattr(engine, "start"):
                    await engine.start()
            manager = Manager(engines, **manager_kwargs)
            await manager.start()
            backend = cls(manager, loop)
            backend._engines = engines
            return backend

        future: Future[InProcessBackend] = asyncio.run_coroutine_threadsafe(boot(), loop)
        try:
            backend = future.result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            raise
        backend._thread = thread
        return backend

    def close(self) -> None:
        """Stop the manager, the engines and the loop thread (threaded backends only)."""
        if self._thread is None:
            return

        async def shutdown() -> None:
            await self.manager.stop()
            for engine in self._engines.values():
                if hasattr(engine, "stop"):
                    await engine.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self._thread = None
        self.loop.close()

    def __enter__(self) -> InProcessBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def create_run(self, spec: RunSpec) -> str:
        """Create the session's run on the manager."""
        return await self.manager.create_run(spec)

    async def add_calls(
        self, run_id: str, calls: list[CallSpec], waits: dict[str, Criterion] | None = None
    ) -> None:
        """Add calls to the open run (`waits`: outputs about to be awaited, and how)."""
        await self.manager.add_calls(run_id, calls, waits)

    async def set_input(self, run_id: str, name: str, value: str) -> None:
        """Give an input its value."""
        await self.manager.set_input(run_id, name, value)

    async def get(self, run_id: str, name: str, perf: Criterion) -> str:
        """Wait for a variable's value."""
        return await self.manager.get(run_id, name, perf=perf)

    async def close_run(self, run_id: str) -> None:
        """Close the run: no more calls."""
        await self.manager.close_run(run_id)
