"""The manager: runs programs on engines, with no client round trip between calls.

`Manager` holds N engines of one model (`engines.py`) and the runs (`runs.py`). A call
whose inputs all have values is *ready* and goes on the ready queue (`ready_queue.py`);
the dispatcher (`dispatcher.py`) offers the policy what the dispatch window allows
(`dispatch_window.py`), renders each offered call when it first offers it (`render.py`),
and starts the assigned calls as tasks (`call_task.py`): a call forks from its shared
prefix (`sharing.py`), fills and generates, and every generated value makes its readers
ready at once (`transitions.py`).

Objectives and task groups come from `objectives.deduce` over the run's declared outputs
and the variables clients wait for with `get(perf=...)`; latency calls run at engine
priority 0, throughput calls at 1. Every state change is an event: listeners are awaited
before the change becomes visible (`events.py`).

For the server (all methods on the manager's event loop):

    manager = Manager({"e0": engine}, listeners=[store_listener])
    await manager.start()                      # or `async with manager:`
    run_id = await manager.create_run(spec, tenant=..., salt=...)   # RunSpec
    await manager.add_calls(run_id, [CallSpec, ...])   # open runs only
    await manager.set_input(run_id, name, value)       # open runs only
    await manager.close_run(run_id)
    value = await manager.get(run_id, name, perf="latency", timeout=30)
    await manager.cancel(run_id); manager.run_status(run_id).to_dict()
    async for event in manager.subscribe(run_id, after=last_seq): ...
    await manager.forget(run_id)               # drop a finished run from memory
    await manager.stop()                       # runs stay resumable (no events)

Errors: ProgramError (a ValueError: bad program, inputs or names, or a program larger
than `max_calls_per_run`, or a generation config beyond the model's vocabulary or
context; 400), InputAlreadySet (an input set twice; 409), TenantBusy (the tenant has
`max_calls_per_tenant` calls ready or running; 429), RunNotFound (404), RunClosedError
(409), VariableFailed and RunCancelled (the value will never come), TimeoutError from
`get(timeout=...)` (the run goes on).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from parrot_backend.contract.engine import EngineClient
from parrot_backend.program import CallSpec, Criterion, ProgramError, RunSpec, UnknownVariableError

from .admission import Admission
from .call_task import PRIORITY
from .dispatcher import Dispatcher
from .engines import EngineSet
from .events import Event, EventLog, RunListener
from .ingest import CallBuilder
from .policy import PolicyConfig
from .ready_queue import ReadyQueue
from .render import PromptTokenizer
from .runs import (
    CallStatus,
    InputAlreadySet,
    Run,
    RunCancelled,
    RunClosedError,
    RunNotFound,
    RunStatus,
    VariableFailed,
)
from .sharing import SharedPrefixes
from .transitions import RunTransitions


@dataclass(slots=True, frozen=True)
class ManagerConfig:
    """Knobs of the manager. `policy` holds the scheduling knobs (`policy.py`)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    static_prefix_min_tokens: int = 4  # a static prefix this long gets its own context
    delay_samples: int = 100_000  # ready -> dispatch delays and round times kept (benchmarks)
    max_calls_per_run: int = 4096  # a program (or an open run, all additions) beyond: refused
    # calls of one tenant that are ready or running at once; a run or calls that would
    # make more ready now are refused (TenantBusy: the server answers 429)
    max_calls_per_tenant: int = 4096


class Manager:
    """Runs programs on engines. Use as `async with Manager(engines) as m:` (or start/stop).

    All methods must be called on the event loop the manager was started on.
    """

    def __init__(
        self,
        engines: Mapping[str, EngineClient],
        *,
        config: ManagerConfig | None = None,
        listeners: Sequence[RunListener] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_set = EngineSet(engines)
        self.engines = self.engine_set.engines  # in service, by id
        self.model = self.engine_set.model
        self.config = config or ManagerConfig()
        self.listeners = list(listeners)
        self.clock = clock
        self.runs: dict[str, Run] = {}
        self.builder = CallBuilder()
        self.tokens = PromptTokenizer.for_engine(next(iter(self.engines.values())))
        self.sharing = SharedPrefixes(self.engines, clock)
        self.queue = ReadyQueue()
        config = self.config
        self.admission = Admission(
            config.max_calls_per_run,
            config.max_calls_per_tenant,
            self.engine_set,
            self.queue,
            self.tokens,
        )
        self.wake = asyncio.Event()  # the ready queue or the engines changed
        self.transitions = RunTransitions(self.listeners, self.queue, clock, self.wake)
        self.dispatcher = Dispatcher(self)
        self.dispatch_delays: deque[float] = deque(maxlen=self.config.delay_samples)
        self.round_durations: deque[float] = deque(maxlen=self.config.delay_samples)
        self.calls_dispatched = 0
        self.tokens_generated = 0  # by calls of this manager (metrics)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the dispatcher on the running loop."""
        self.dispatcher.start()

    async def stop(self) -> None:
        """Stop the dispatcher and every running call, freeing their engine contexts.

        Runs are not marked cancelled (no event): a store can resume them after a
        restart. Pending `get`s raise RunCancelled. Engines are not stopped.
        """
        await self.dispatcher.stop()
        self.queue.clear()
        for run in self.runs.values():
            run.queued.clear()
        tasks = [t for run in self.runs.values() for t in run.tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.sharing.close()  # engines may outlive this manager: leave nothing behind
        for run in self.runs.values():
            run.end_waits(f"run {run.run_id}: the manager stopped")

    async def __aenter__(self) -> Manager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def counts(self) -> dict[str, int]:
        """Gauges and counters for metrics: calls waiting for an engine, calls running,
        runs held in memory, engines, shared prefixes held on engines (each one engine
        context), calls dispatched, tokens generated, shared-prefix fills and forks, and
        the prompt tokens those forks took from a prefix instead of computing them."""
        return {
            "pending_calls": len(self.queue),
            "running_calls": sum(load.batch for load in self.engine_set.load.values()),
            "runs": len(self.runs),
            "engines": len(self.engines),
            "prefixes": len(self.sharing.table),
            "calls_dispatched": self.calls_dispatched,
            "tokens_generated": self.tokens_generated,
            "prefix_fills": sum(self.sharing.fills.values()),
            "prefix_forks": sum(self.sharing.forks.values()),
            "prefix_fork_tokens": sum(self.sharing.fork_tokens.values()),
        }

    def inflight(self, tenant: str | None) -> int:
        """Calls of `tenant` that are ready (queued for an engine) or running."""
        return self.queue.inflight.get(tenant, 0)

    # ------------------------------------------------------------------ engines
    def add_engine(self, engine_id: str, engine: EngineClient) -> None:
        """Put an engine in service (a remote engine that registered)."""
        self.engine_set.add(engine_id, engine)
        self.wake.set()

    async def remove_engine(self, engine_id: str) -> list[str]:
        """Take an engine out of service (it died or left): its prefixes are forgotten and
        the calls running on it are dispatched again elsewhere. Execution is at least once:
        a re-dispatched call emits `call_started` and its tokens again, but each variable
        is set once, and outputs it already produced are kept. Returns the calls moved."""
        if not self.engine_set.remove(engine_id):
            return []
        self.sharing.table.drop_engine(engine_id)
        moved = [
            (run, name, task)
            for run in self.runs.values()
            for name, task in list(run.tasks.items())
            if run.calls[name].engine == engine_id
        ]
        for _, _, task in moved:
            task.cancel()
        await asyncio.gather(*(t for _, _, t in moved), return_exceptions=True)
        for run, name, _ in moved:
            self.transitions.requeue(run, name)
        return [f"{run.run_id}/{name}" for run, name, _ in moved]

    # ------------------------------------------------------------------ public API
    async def create_run(
        self,
        spec: RunSpec,
        *,
        tenant: str | None = None,
        salt: str | None = None,
        run_id: str | None = None,
        known: Mapping[str, str] | None = None,
        waits: Mapping[str, Criterion] | None = None,
        stated: bool = False,
    ) -> str:
        """Start a run; returns its id. Ready calls start at once.

        `salt` (server-derived, per tenant) keys the run's prefixes unless the program is
        public; without it the tenant name separates tenants. `run_id` lets a store choose
        the id. `known` gives generated values recovered from a store: calls whose outputs
        are all known do not run again. `waits` and `stated` are a recovered run's waits
        beyond its outputs (added calls' outputs, `get`s with perf) and whether a client
        stated a criterion (the `objectives` events tell both). Raises ProgramError (bad
        program or inputs).
        """
        program, program_json = self.builder.build(spec)  # both read-only (shared)
        run_id = run_id or os.urandom(16).hex()  # 128 random bits, as uuid4().hex
        if run_id in self.runs:
            raise ValueError(f"run {run_id} already exists")
        if known is None:  # a new run (a recovered one was admitted in its first life)
            self.admission.check_size(len(program.calls), "the program")
            # (default configs fit any model: limits only when a call gives its own)
            self.admission.check_calls(
                program.calls.values(),
                tenant,
                spec.inputs,
                limits=any(c.outputs for c in spec.program.calls),
            )
            self.admission.check_context(program.calls.values(), spec.inputs)
        known = dict(known or {})
        stray = [n for n in known if n not in program.variables or program.variables[n].is_input]
        if stray:
            raise ProgramError(f"known values for non-generated variables: {stray}")
        if program.public:
            key_salt = None
        else:
            key_salt = f"s:{salt}" if salt is not None else f"t:{tenant or ''}"
        run = Run(
            run_id, program, tenant, key_salt, spec.open, dict(spec.outputs), EventLog(run_id)
        )
        run.calls = {name: CallStatus("waiting") for name in program.calls}
        run.waits = dict(waits or {})
        run.stated = bool(spec.outputs) or stated
        self.runs[run_id] = run
        payload = {
            "program": program_json,
            "inputs": dict(spec.inputs),
            "outputs": dict(spec.outputs),
            "open": spec.open,
            "tenant": tenant,
        }
        try:
            await self.transitions.emit(run, "run_created", payload)
        except BaseException:
            del self.runs[run_id]
            raise
        run.values.update(spec.inputs)
        run.values.update(known)
        for name, call in program.calls.items():
            # a call with no output has nothing to do; one whose outputs are all known
            # (recovered) is done
            if not call.outputs or (known and all(out in known for out in call.outputs)):
                run.calls[name].state = "finished"
        try:
            await self.transitions.deduce(run)
            self.transitions.ready_calls(run, program.calls)
            await self.transitions.maybe_finish(run)
        except BaseException:
            await self.cancel(run_id)  # recorded as created: record its end too
            raise
        return run_id

    async def add_calls(
        self,
        run_id: str,
        calls: Sequence[CallSpec],
        waits: Mapping[str, Criterion] | None = None,
        *,
        inputs: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> list[str]:
        """Add calls to an open run; returns their names (unnamed ones become `#<index>`).
        `waits`: outputs a client is about to `get`, with its criterion, counted by the
        deduction that places the new calls (a wait already `latency` stays so). Then
        set `inputs` and, with `close`, close the run: all or nothing, everything is
        checked (the inputs, and with `close` that the run may close) before anything
        changes."""
        run = self._open_run(run_id)
        async with run.mutex:
            run = self._open_run(run_id)  # closed while this waited?
            inputs = dict(inputs or {})
            for name, value in inputs.items():
                self._check_input(run, name, value)
            self._check_context(run, inputs)
            names = await self._add_calls(run, calls, waits, inputs, close) if calls else []
            if not calls and close:
                self._check_close(run, inputs)
            for name, value in inputs.items():
                await self.transitions.set_value(run, name, value, source="input", call=None)
            if close:
                await self._close(run)
            return names

    async def _add_calls(
        self,
        run: Run,
        calls: Sequence[CallSpec],
        waits: Mapping[str, Criterion] | None,
        inputs: Mapping[str, str],
        close: bool,
    ) -> list[str]:
        base = len(run.program.calls)
        self.admission.check_size(base + len(calls), f"run {run.run_id}")
        built = self.builder.calls(calls, base)
        self.admission.check_calls(built, run.tenant, run.values)
        self.admission.check_context(built, {**run.values, **inputs})
        given = [o for c in built for o in c.outputs if o in run.values or o in inputs]
        if given:
            raise ProgramError(f"variables already given as inputs cannot be generated: {given}")
        run.program.add_calls(built)
        payload = {
            "calls": [
                spec.model_copy(update={"name": c.name}).model_dump(mode="json")
                for spec, c in zip(calls, built, strict=True)
            ]
        }
        try:
            if close:  # the run must be able to close with these calls: else none is added
                self._check_close(run, inputs)
            await self.transitions.emit(run, "calls_added", payload)
        except BaseException:
            for call in reversed(built):
                run.program._remove(call)  # not recorded: the calls must not exist either
            raise
        for call in built:
            run.calls[call.name] = CallStatus("waiting")
        changed = False
        for name, perf in (waits or {}).items():
            changed = changed or not run.stated
            run.stated = True
            if run.criterion(name) not in ("latency", perf):  # latency stays
                run.waits[name] = perf
                changed = True
        await self.transitions.deduce(run, waits_changed=changed)
        names = [c.name for c in built]
        for name in names:
            bad = [v for v in run.program.calls[name].inputs if v in run.failed]
            if bad:
                reason = f"input {bad[0]!r} failed: {run.failed[bad[0]]}"
                await self.transitions.fail_calls(run, {name: reason}, ran=False)
        self.transitions.ready_calls(run, names)
        return names

    async def set_input(self, run_id: str, name: str, value: str) -> None:
        """Give an input variable of an open run its value; its readers become ready.
        Once: a second value (even one racing the first) raises InputAlreadySet."""
        run = self._open_run(run_id)
        async with run.mutex:
            run = self._open_run(run_id)
            self._check_input(run, name, value)
            self._check_context(run, {name: value})
            await self.transitions.set_value(run, name, value, source="input", call=None)

    def _check_context(self, run: Run, inputs: Mapping[str, str]) -> None:
        """Raise ProgramError if setting `inputs` would complete the text of a call of
        `run` that cannot fit the model's context."""
        if not inputs:
            return
        readers = [c for c in run.program.calls.values() if any(i in inputs for i in c.inputs)]
        self.admission.check_context(readers, {**run.values, **inputs})

    @staticmethod
    def _check_input(run: Run, name: str, value: str) -> None:
        var = run.program.variables.get(name)
        if var is not None and var.producer is not None:
            raise ProgramError(f"variable {name!r} is generated by call {var.producer!r}")
        if name in run.values:
            raise InputAlreadySet(f"input {name!r} already has a value")
        if not isinstance(value, str):
            raise TypeError(f"input values are strings, got {type(value).__name__}")

    async def close_run(self, run_id: str) -> None:
        """Close an open run: no more calls or inputs. Every input must have a value."""
        run = self._open_run(run_id)
        async with run.mutex:
            run = self._open_run(run_id)
            self._check_close(run)
            await self._close(run)

    @staticmethod
    def _check_close(run: Run, inputs: Mapping[str, str] | None = None) -> None:
        """Raise unless the run may close once `inputs` are set too."""
        given = [
            n
            for n in (*run.values, *(inputs or ()))
            if n not in run.program.variables or run.program.variables[n].is_input
        ]
        run.program.check_run(given, [o for o in run.outputs if o not in run.values], closed=True)

    async def _close(self, run: Run) -> None:
        await self.transitions.emit(run, "run_closed", {})
        run.open = False
        await self.transitions.maybe_finish(run)

    async def get(
        self,
        run_id: str,
        name: str,
        perf: Criterion | None = "latency",
        timeout: float | None = None,
    ) -> str:
        """Wait for a variable's value. `perf` tells the objective deduction what the
        client needs. None: no preference; the objectives stay as the client stated them
        (the run's outputs, an earlier `perf`), and only a run with none stated waits with
        latency (a client waiting for a value it said nothing about wants it now).
        Raises VariableFailed, RunCancelled, UnknownVariableError, or TimeoutError after
        `timeout` seconds (the run goes on)."""
        if perf is not None and perf not in PRIORITY:
            raise ValueError(f"perf must be 'latency' or 'throughput', got {perf!r}")
        run = self._run(run_id)
        if name in run.values:
            return run.values[name]
        if name in run.failed:
            raise VariableFailed(run_id, name, run.failed[name])
        if run.state == "cancelled":
            raise RunCancelled(f"run {run_id} was cancelled")
        if name not in run.program.variables and not run.open:
            raise UnknownVariableError(f"run {run_id} has no variable {name!r}")
        # register the wait before deducing: deduction awaits listeners, and a value set
        # meanwhile must resolve this future
        fut = run.futures.get(name)
        if fut is None:
            fut = run.futures[name] = asyncio.get_running_loop().create_future()
        changed = False
        if perf is not None:
            changed = not run.stated
            run.stated = True
        elif not run.stated:
            perf = "latency"
        if perf is not None and run.criterion(name) not in ("latency", perf):
            run.waits[name] = perf
            changed = True
        if changed:
            await self.transitions.deduce(run, waits_changed=True)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)

    async def cancel(self, run_id: str) -> None:
        """Stop a run: its calls stop, their engine contexts are freed, and every pending
        `get` raises RunCancelled. Finished runs are left alone."""
        run = self._run(run_id)
        # after a client's change in progress (added calls, an input, a close): its events
        # then all come before the run's end, and a second cancel answers after the first
        async with run.mutex:
            await self._cancel(run)

    async def _cancel(self, run: Run) -> None:
        run_id = run.run_id
        if run.state != "running" or run.finishing:
            return
        run.state = "cancelled"  # no call of this run starts from here on
        for name in list(run.queued):
            self.queue.remove(run, name)
        tasks = list(run.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for status in run.calls.values():
            if status.state not in ("finished", "failed"):
                status.state = "cancelled"
        try:
            await self.transitions.emit(run, "run_finished", {"status": "cancelled"})
        finally:
            run.end_waits(f"run {run_id} was cancelled")

    def run_status(self, run_id: str) -> RunStatus:
        """A snapshot of the run: state, calls, values, failures, pending variables."""
        return self._run(run_id).status()

    def subscribe(self, run_id: str, after: int = 0) -> AsyncIterator[Event]:
        """The run's events with seq > `after`, then live ones until the run ends."""
        return self._run(run_id).log.subscribe(after)

    async def abandon(self, run_id: str) -> None:
        """Drop a run that another manager owns: its calls here stop and free their
        contexts, waiters get RunCancelled, and no event is recorded."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return
        run.state = "cancelled"  # in memory only: the owner records the run's real end
        for name in list(run.queued):
            self.queue.remove(run, name)
        me = asyncio.current_task()
        tasks = [t for t in run.tasks.values() if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        run.end_waits(f"run {run_id} is run by another manager")

    async def forget(self, run_id: str) -> None:
        """Drop a run from memory (cancelling it first if it still runs)."""
        await self.cancel(run_id)
        run = self.runs.pop(run_id)
        run.log.close()

    # ------------------------------------------------------------------ lookups
    def _run(self, run_id: str) -> Run:
        try:
            return self.runs[run_id]
        except KeyError:
            raise RunNotFound(f"no run {run_id!r}") from None

    def _open_run(self, run_id: str) -> Run:
        run = self._run(run_id)
        if not run.open or run.state != "running":
            raise RunClosedError(
                f"run {run_id} is {'closed' if run.state == 'running' else run.state}"
            )
        return run
