"""Run and variable transitions: every state change of a run, told as an event first.

A change is emitted (`emit`: the listeners are awaited, then the event is logged) before it
becomes visible to `get` waiters, `run_status` and subscribers; a listener that raises
makes the change fail (`events.py`). The transitions:

- a variable gets its value (`set_value`): its readers whose inputs are all set become
  ready (`ready_calls`) and go on the ready queue;
- calls fail (`fail_calls`), with their unfinished outputs and everything downstream;
- a run finishes (`maybe_finish`) once it is closed and no call can change a variable;
- the objectives and task groups are deduced again (`deduce`) when calls are added or a
  client starts waiting, and the queued calls take the new ones;
- a call whose engine went away goes back on the queue (`requeue`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .events import Event, RunListener
from .objectives import deduce_shared
from .ready_queue import ReadyCall, ReadyQueue
from .runs import Run


class RunTransitions:
    """Applies state changes to runs, telling `listeners` first. Ready calls go on
    `queue`, and `wake` is set for the dispatcher."""

    def __init__(
        self,
        listeners: Sequence[RunListener],
        queue: ReadyQueue,
        clock: Callable[[], float],
        wake: asyncio.Event,
    ) -> None:
        self.listeners = listeners
        self._delivering: set[asyncio.Task[None]] = set()  # groups of values being told
        self.queue = queue
        self.clock = clock
        self.wake = wake

    async def emit(self, run: Run, type: str, payload: dict[str, Any]) -> Event:
        """Tell the listeners, then log the event (the caller applies the change after)."""
        if not self.listeners:
            return run.log.append(type, payload)
        async with run.lock:  # listeners see a run's events in seq order
            for listener in self.listeners:
                await listener.on_event(run.run_id, type, payload)
            return run.log.append(type, payload)

    async def deduce(self, run: Run, waits_changed: bool = False) -> None:
        """Deduce the run's objectives again; emit them if they changed, or if what they
        are deduced from did (`waits_changed`: the run's waits or `stated`, which the event
        carries for a store to resume the run with), and give the queued calls theirs."""
        deduction = deduce_shared(run.program, run.criteria())
        old = run.deduction
        changed = old is None or (old is not deduction and old.calls != deduction.calls)
        if changed or waits_changed:
            payload = {"calls": deduction.as_json(), "waits": dict(run.waits), "stated": run.stated}
            await self.emit(run, "objectives", payload)
        run.deduction = deduction
        for name, ready in run.queued.items():
            self.queue.set_objective(ready, *run.objective(name))

    async def set_value(
        self, run: Run, name: str, value: str, *, source: str, call: str | None
    ) -> None:
        """Give a variable its value; its readers with every input set become ready."""
        payload = {"name": name, "value": value, "source": source, "call": call}
        if self.listeners:
            await self._emit_value(run, payload)
        else:
            run.log.append("variable_ready", payload)
        run.values[name] = value
        run.resolve(name)
        var = run.program.variables.get(name)
        if var is not None:
            self.ready_calls(run, var.consumers)

    async def _emit_value(self, run: Run, payload: dict[str, Any]) -> None:
        """`emit` of a `variable_ready`, grouped: the values that arrive while the run's
        events wait to be written (a fan-out's calls ending in one engine step) are told
        to the listeners together, in arrival order: `on_values(run_id, payloads)` where
        a listener has it (the store then commits them in one transaction, not one commit
        each in turn: 8 values took ~25 ms after the last engine step), else `on_event`
        for each. A listener that raises fails every value of the group. The group is
        written by a task of its own, so a caller cancelled while it waits (its run
        cancelled) takes no value of the others down with it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        run.value_outbox.append((payload, fut))
        if len(run.value_outbox) == 1:  # the first of a group: it writes the group
            task = asyncio.create_task(self._deliver_values(run))
            self._delivering.add(task)
            task.add_done_callback(self._delivering.discard)
        await fut

    async def _deliver_values(self, run: Run) -> None:
        async with run.lock:  # after the run's earlier events, as `emit`
            group, run.value_outbox = run.value_outbox, []
            payloads = [p for p, _ in group]
            try:
                for listener in self.listeners:
                    many = getattr(listener, "on_values", None)
                    if many is not None:
                        await many(run.run_id, payloads)
                    else:
                        for p in payloads:
                            await listener.on_event(run.run_id, "variable_ready", p)
            except BaseException as exc:
                for _, f in group:
                    if not f.done():
                        f.set_exception(
                            exc
                            if isinstance(exc, Exception)
                            else RuntimeError(f"writing the value failed: {exc!r}")
                        )
                        f.exception()  # (a cancelled caller never retrieves it)
                if not isinstance(exc, Exception):
                    raise
                return
            for p, f in group:
                run.log.append("variable_ready", p)
                if not f.done():
                    f.set_result(None)

    async def fail_calls(self, run: Run, failing: dict[str, str], ran: bool = True) -> None:
        """Fail calls (name -> reason), their unfinished outputs, and everything downstream.

        `ran`: the calls ran and failed (an engine error), rather than never ran because
        an input failed; downstream calls never ran.
        """
        queue = [(name, reason, ran) for name, reason in failing.items()]
        while queue:
            name, reason, ran = queue.pop(0)
            status = run.calls[name]
            if status.state in ("finished", "failed", "cancelled"):
                continue
            self.queue.remove(run, name)
            await self.emit(run, "call_failed", {"call": name, "error": reason})
            status.state, status.error = "failed", reason
            why = f"call {name!r} {'failed' if ran else 'not run'}: {reason}"
            for out in run.program.calls[name].outputs:
                if out in run.values or out in run.failed:
                    continue
                await self.emit(run, "variable_failed", {"name": out, "error": why})
                run.failed[out] = why
                run.resolve(out)
                for consumer in run.program.variables[out].consumers:
                    queue.append((consumer, f"input {out!r} failed: {why}", False))
        await self.maybe_finish(run)

    async def maybe_finish(self, run: Run) -> None:
        """End the run if it is closed and no call can still change a variable."""
        if not run.can_finish():
            return
        status = "failed" if any(c.state == "failed" for c in run.calls.values()) else "finished"
        run.finishing = True  # a cancel meanwhile would record a second end
        try:
            await self.emit(run, "run_finished", {"status": status})
        finally:
            run.finishing = False
        run.state = status
        run.log.close()

    def ready_calls(self, run: Run, names: Sequence[str] | Mapping[str, Any]) -> None:
        """Queue every call among `names` that waits and has all its inputs."""
        if run.state != "running":
            return
        queued = False
        for name in names:
            status = run.calls.get(name)
            if status is None or status.state != "waiting" or not run.inputs_ready(name):
                continue
            status.state = "ready"
            ready = ReadyCall(f"{run.run_id}/{name}", run, name, self.clock())
            ready.objective, ready.group = run.objective(name)
            self.queue.add(ready)
            queued = True
        if queued:
            self.wake.set()

    def requeue(self, run: Run, name: str) -> None:
        """Queue a running call again (its engine went away) if its run still runs."""
        status = run.calls[name]
        if status.state == "running" and run.state == "running":
            status.state, status.engine = "waiting", None
            self.ready_calls(run, [name])
