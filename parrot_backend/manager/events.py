"""Run events: the listener hook (write-before-acknowledge) and the in-memory stream per run.

Every state change of a run is an event `(run_id, type, payload)`. The manager awaits each
`RunListener` before the change becomes visible (to `get()` waiters, `run_status` and
subscribers), so a store that writes events in `on_event` has persisted a value before any
client can see it. A listener that raises makes the change fail: for a call event the call
fails, for `create_run` the run is not created.

Event types and payloads (all JSON-ready):

- `run_created`     {"program": ProgramSpec dict, "inputs", "outputs", "open", "tenant"}
- `calls_added`     {"calls": [CallSpec dicts, every call named]}
- `objectives`      {"calls": {call: {"objective": "latency"|"throughput", "group": int|None}},
                     "waits": {variable: criterion}, "stated": bool} (waits beyond the
                     run's outputs: added calls' outputs, `get(perf=...)`; `stated`: a
                     client stated a criterion. Emitted when either part changes.)
- `run_closed`      {}
- `call_started`    {"call", "engine", "objective", "group", "prefix_tokens"}
- `token`           {"call", "variable", "text", "token_id"}
- `variable_ready`  {"name", "value", "source": "input"|"call", "call": str|None}
- `variable_failed` {"name", "error"}
- `call_finished`   {"call", "prompt_tokens", "completion_tokens", "output_tokens":
                     {output: completion tokens}, "finish_reasons": {output: reason}}
                     (a store that settles a call whose end was lost logs one of its
                     own: {"call", "recovered": true})
- `call_failed`     {"call", "error"}
- `run_finished`    {"status": "finished"|"failed"|"cancelled"}
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

EVENT_TYPES = (
    "run_created",
    "calls_added",
    "objectives",
    "run_closed",
    "call_started",
    "token",
    "variable_ready",
    "variable_failed",
    "call_finished",
    "call_failed",
    "run_finished",
)


@runtime_checkable
class RunListener(Protocol):
    """Called for every run event, before the change it reports becomes visible."""

    async def on_event(self, run_id: str, type: str, payload: dict[str, Any]) -> None: ...


class Event(NamedTuple):
    """One event of a run; `seq` counts from 1 per run, without gaps.

    Read-only, payload included: every subscriber gets the same object, and a
    `run_created` program may be the one dict all runs of a workflow share
    (`ingest.CallBuilder.build`). A named tuple rather than a frozen dataclass: it is as
    cheap to make as a plain one (a frozen dataclass costs ~0.7 us more, and the manager
    makes several per call), and once the collector has seen that its payload holds no
    containers it stops tracking it, so the events of runs held in memory are not walked
    by every later collection.
    """

    run_id: str
    seq: int
    type: str
    payload: dict[str, Any]


_new_tuple = tuple.__new__


class EventLog:
    """The events of one run, kept in memory, with live subscribers.

    `subscribe(after)` replays the events after seq `after`, then follows new ones until
    the log is closed (the run finished or was forgotten).
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.events: list[Event] = []
        self.closed = False
        self._changed: asyncio.Event | None = None  # made when a subscriber waits

    def append(self, type: str, payload: dict[str, Any]) -> Event:
        """Record an event (already acknowledged by the listeners) and wake subscribers."""
        events = self.events
        # what Event(...) makes, without the named tuple's Python-level __new__
        event = _new_tuple(Event, (self.run_id, len(events) + 1, type, payload))
        events.append(event)
        if self._changed is not None:  # _wake(), inline
            self._changed.set()
            self._changed = None
        return event

    def close(self) -> None:
        """No more events: subscribers end after draining what is logged."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        # one Event per generation: waiters that woke keep theirs, new waiters get a fresh
        # one (made by the next waiter: with nobody waiting there is nothing to wake)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def subscribe(self, after: int = 0) -> AsyncIterator[Event]:
        """Events with `seq > after`, live, until the log closes."""
        sent = max(after, 0)
        while True:
            while sent < len(self.events):
                sent += 1
                yield self.events[sent - 1]
            if self.closed:
                return
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
