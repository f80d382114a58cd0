"""Wake-ups per run: the persister signals a commit, SSE streams wait for one.

Streams read the store's event log; between reads they wait here, with a timeout, so a
stream also notices events committed by another process (it then polls).
"""

from __future__ import annotations

import asyncio
import contextlib


class Notifier:
    """One `asyncio.Event` generation per run: `wake` releases every current waiter."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._streams: dict[str, int] = {}

    def attach(self, run_id: str) -> None:
        """A stream starts following `run_id`."""
        self._streams[run_id] = self._streams.get(run_id, 0) + 1

    def detach(self, run_id: str) -> None:
        """A stream ended; the last one leaving drops the run's wake-up event."""
        left = self._streams.get(run_id, 1) - 1
        if left > 0:
            self._streams[run_id] = left
        else:
            self._streams.pop(run_id, None)
            self._events.pop(run_id, None)

    @property
    def watched(self) -> int:
        """Runs with a stream attached (for leak tests)."""
        return len(self._streams)

    def wake(self, run_id: str) -> None:
        """Something was committed for `run_id`."""
        event = self._events.pop(run_id, None)
        if event is not None:
            event.set()

    def watch(self, run_id: str) -> asyncio.Event:
        """The event the next `wake(run_id)` sets. Take it *before* reading the store, so a
        commit between the read and the wait is not missed."""
        return self._events.setdefault(run_id, asyncio.Event())

    @staticmethod
    async def wait(event: asyncio.Event, timeout: float) -> None:
        """Return when `event` is set, or after `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
