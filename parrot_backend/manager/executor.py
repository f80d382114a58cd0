"""The run executor: runs programs on engines, with no client round trip between calls.

`Manager` holds N engines (one model) and the runs. A call whose inputs all have values
is *ready* and waits for the dispatcher. A round renders the ready calls it offers for the
first time (the prompt tokenized as one text, and its shareable prefixes: `render.py`,
`prefix.py`), picks which prefixes to share (`sharing.py`), asks `policy.schedule` for engines,
and starts the assigned calls. With a backlog, a round offers the policy only as many
calls as the engines have batch slots (`Manager._window`: aged, then latency, then
throughput calls, each run its fair share first); a task group's members all count
against the slots and are offered together or not at all, and a group larger than the
slots is offered whole when it comes first in that order. A running call forks from its
shared prefix, fills and generates (`execute.py`); every generated value makes its
consumers ready at once.

Objectives come from `objectives.deduce` over the run's declared outputs and the
variables clients wait for with `get(perf=...)`; latency calls run at engine priority 0,
throughput calls at 1. Every state change is an event: listeners are awaited before the
change becomes visible (`events.py`).

One manager serves one model: every engine must have the same `model_name` (prefix keys
and segment tokens are computed once per call, with the first engine's tokenizer).

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
context; 400), TenantBusy (the tenant has `max_calls_per_tenant` calls ready or running;
429), RunNotFound (404), RunClosedError (409), VariableFailed and RunCancelled (the
value will never come), TimeoutError from `get(timeout=...)` (the run goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parrot_backend.contract.engine import EngineClient, EngineStats, TokenDelta
from parrot_backend.contract.errors import EngineUnavailable
from parrot_backend.program import (
    Call,
    CallSpec,
    Criterion,
    ProgramError,
    RunSpec,
    Text,
    UnknownVariableError,
)

from .events import Event, EventLog, RunListener
from .execute import CallRunner
from .ingest import CallBuilder
from .objectives import deduce_shared
from .policy import EngineSnapshot, PendingCall, PolicyConfig, schedule
from .prefix import Prefix
from .render import CallPlan, PromptTokenizer, Step, render_call
from .runs import (
    CallStatus,
    Run,
    RunCancelled,
    RunClosedError,
    RunNotFound,
    RunOwnedElsewhere,
    RunStatus,
    TenantBusy,
    VariableFailed,
)
from .sharing import Attached, SharedPrefixes, shareable

log = logging.getLogger(__name__)

PRIORITY = {"latency": 0, "throughput": 1}  # engine priority: lower runs first


@dataclass(slots=True, frozen=True)
class ManagerConfig:
    """Knobs of the executor. `policy` holds the scheduling knobs (`policy.py`)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    static_prefix_min_tokens: int = 4  # a static prefix this long gets its own context
    delay_samples: int = 100_000  # ready -> dispatch delays and round times kept (benchmarks)
    max_calls_per_run: int = 4096  # a program (or an open run, all additions) beyond: refused
    # calls of one tenant that are ready or running at once; a run or calls that would
    # make more ready now are refused (TenantBusy: the server answers 429)
    max_calls_per_tenant: int = 4096


@dataclass(slots=True)
class _Ready:
    """A ready call waiting for the dispatcher.

    It is rendered (`plan`, `prefixes`, `static_key`) when a dispatcher round first
    offers it to the policy, not when it becomes ready: a backlog holds no plans or keys,
    and what a call renders lives only as long as it waits for a slot and runs (its
    inputs never change once set, so rendering later gives the same plan).
    """

    call_id: str  # "<run id>/<call name>", unique across runs
    run: Run
    name: str
    enqueued_at: float
    objective: Criterion = "throughput"  # kept current by _deduce
    group: int | None = None
    plan: CallPlan | None = None  # set by `Manager._render`
    prefixes: tuple[Prefix, ...] = ()
    static_key: str | None = None
    shared: tuple[Prefix, ...] = ()


@dataclass(slots=True)
class _Load:
    """Calls this manager runs on one engine."""

    batch: int = 0
    latency: int = 0
    tokens: int = 0


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
        if not engines:
            raise ValueError("a manager needs at least one engine")
        models = {e.model_name for e in engines.values()}
        if len(models) != 1:
            raise ValueError(f"one manager serves one model; engines serve {sorted(models)}")
        self.engines = dict(engines)
        self.model = models.pop()
        self.config = config or ManagerConfig()
        self.listeners = list(listeners)
        self.clock = clock
        self.runs: dict[str, Run] = {}
        self.builder = CallBuilder()
        self.tokens = PromptTokenizer.for_engine(next(iter(self.engines.values())))
        self.sharing = SharedPrefixes(self.engines, clock)
        self.dispatch_delays: deque[float] = deque(maxlen=self.config.delay_samples)
        self.round_durations: deque[float] = deque(maxlen=self.config.delay_samples)
        self.calls_dispatched = 0
        self.tokens_generated = 0  # by calls of this manager (metrics)
        self._capacity: dict[str, int] = {}
        self._load = {eid: _Load() for eid in self.engines}
        self._pending: dict[str, _Ready] = {}  # by call id, in enqueue order
        self._pending_runs: dict[str, int] = {}  # run id -> its calls in `_pending`
        # tenant -> its runs with calls in `_pending` (the window's fair shares)
        self._pending_tenants: dict[str | None, int] = {}
        self._inflight: dict[str | None, int] = {}  # tenant -> calls ready or running
        self._limits = _model_limits(self.engines.values())
        self._pending_latency = 0  # calls in `_pending` whose objective is latency
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the dispatcher on the running loop."""
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="parrot-dispatch")

    async def stop(self) -> None:
        """Stop the dispatcher and every running call, freeing their engine contexts.

        Runs are not marked cancelled (no event): a store can resume them after a
        restart. Pending `get`s raise RunCancelled. Engines are not stopped.
        """
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            self._dispatcher = None
        self._pending.clear()
        self._pending_runs.clear()
        self._pending_tenants.clear()
        self._inflight.clear()
        self._pending_latency = 0
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
        context), calls dispatched, tokens generated, shared-prefix fills and forks."""
        return {
            "pending_calls": len(self._pending),
            "running_calls": sum(load.batch for load in self._load.values()),
            "runs": len(self.runs),
            "engines": len(self.engines),
            "prefixes": len(self.sharing.table),
            "calls_dispatched": self.calls_dispatched,
            "tokens_generated": self.tokens_generated,
            "prefix_fills": sum(self.sharing.fills.values()),
            "prefix_forks": sum(self.sharing.forks.values()),
        }

    # ------------------------------------------------------------------ engines
    def add_engine(self, engine_id: str, engine: EngineClient) -> None:
        """Put an engine in service (a remote engine that registered)."""
        if engine.model_name != self.model:
            raise ValueError(
                f"engine {engine_id!r} serves {engine.model_name!r}; "
                f"this manager serves {self.model!r}"
            )
        if engine_id in self.engines:
            raise ValueError(f"engine {engine_id!r} is already in service")
        self.engines[engine_id] = engine
        self._load[engine_id] = _Load()
        self._limits = _model_limits(self.engines.values())
        self._wake.set()

    async def remove_engine(self, engine_id: str) -> list[str]:
        """Take an engine out of service (it died or left): its prefixes are forgotten and
        the calls running on it are dispatched again elsewhere. Execution is at least once:
        a re-dispatched call emits `call_started` and its tokens again, but each variable
        is set once, and outputs it already produced are kept. Returns the calls moved."""
        if self.engines.pop(engine_id, None) is None:
            return []
        self._capacity.pop(engine_id, None)
        if self.engines:  # the limits of the last engine stand while none is in service
            self._limits = _model_limits(self.engines.values())
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
            self._requeue(run, name)
        return [f"{run.run_id}/{name}" for run, name, _ in moved]

    def _requeue(self, run: Run, name: str) -> None:
        status = run.calls[name]
        if status.state == "running" and run.state == "running":
            status.state, status.engine = "waiting", None
            self._ready_calls(run, [name])

    # ------------------------------------------------------------------ public API
    async def create_run(
        self,
        spec: RunSpec,
        *,
        tenant: str | None = None,
        salt: str | None = None,
        run_id: str | None = None,
        known: Mapping[str, str] | None = None,
    ) -> str:
        """Start a run; returns its id. Ready calls start at once.

        `salt` (server-derived, per tenant) keys the run's prefixes unless the program is
        public; without it the tenant name separates tenants. `run_id` lets a store choose
        the id. `known` gives generated values recovered from a store: calls whose outputs
        are all known do not run again. Raises ProgramError (bad program or inputs).
        """
        program, program_json = self.builder.build(spec)  # both read-only (shared)
        run_id = run_id or os.urandom(16).hex()  # 128 random bits, as uuid4().hex
        if run_id in self.runs:
            raise ValueError(f"run {run_id} already exists")
        if known is None:  # a new run (a recovered one was admitted in its first life)
            self._check_size(len(program.calls), "the program")
            if any(c.outputs for c in spec.program.calls):  # default configs fit any model
                self._check_limits(program.calls.values())
            given = spec.inputs
            self._check_tenant(tenant, sum(1 for c in program.calls.values()
                                           if c.outputs and all(i in given for i in c.inputs)))
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
        self.runs[run_id] = run
        payload = {
            "program": program_json,
            "inputs": dict(spec.inputs),
            "outputs": dict(spec.outputs),
            "open": spec.open,
            "tenant": tenant,
        }
        try:
            await self._emit(run, "run_created", payload)
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
            await self._deduce(run)
            self._ready_calls(run, program.calls)
            await self._maybe_finish(run)
        except BaseException:
            await self.cancel(run_id)  # recorded as created: record its end too
            raise
        return run_id

    async def add_calls(self, run_id: str, calls: Sequence[CallSpec]) -> list[str]:
        """Add calls to an open run; returns their names (unnamed ones become `#<index>`)."""
        run = self._open_run(run_id)
        base = len(run.program.calls)
        self._check_size(base + len(calls), f"run {run_id}")
        built = self.builder.calls(calls, base)
        self._check_limits(built)
        values = run.values
        self._check_tenant(run.tenant, sum(1 for c in built
                                           if c.outputs and all(i in values for i in c.inputs)))
        given = [o for c in built for o in c.outputs if o in run.values]
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
            await self._emit(run, "calls_added", payload)
        except BaseException:
            for call in reversed(built):
                run.program._remove(call)  # not recorded: the calls must not exist either
            raise
        for call in built:
            run.calls[call.name] = CallStatus("waiting")
        await self._deduce(run)
        names = [c.name for c in built]
        for name in names:
            bad = [v for v in run.program.calls[name].inputs if v in run.failed]
            if bad:
                reason = f"input {bad[0]!r} failed: {run.failed[bad[0]]}"
                await self._fail_calls(run, {name: reason}, ran=False)
        self._ready_calls(run, names)
        return names

    async def set_input(self, run_id: str, name: str, value: str) -> None:
        """Give an input variable of an open run its value; its readers become ready."""
        run = self._open_run(run_id)
        var = run.program.variables.get(name)
        if var is not None and var.producer is not None:
            raise ProgramError(f"variable {name!r} is generated by call {var.producer!r}")
        if name in run.values:
            raise ProgramError(f"input {name!r} already has a value")
        if not isinstance(value, str):
            raise TypeError(f"input values are strings, got {type(value).__name__}")
        await self._set_value(run, name, value, source="input", call=None)

    async def close_run(self, run_id: str) -> None:
        """Close an open run: no more calls or inputs. Every input must have a value."""
        run = self._open_run(run_id)
        given = [
            n
            for n in run.values
            if n not in run.program.variables or run.program.variables[n].is_input
        ]
        run.program.check_run(given, [o for o in run.outputs if o not in run.values], closed=True)
        await self._emit(run, "run_closed", {})
        run.open = False
        await self._maybe_finish(run)

    async def get(
        self,
        run_id: str,
        name: str,
        perf: Criterion = "latency",
        timeout: float | None = None,
    ) -> str:
        """Wait for a variable's value. `perf` tells the objective deduction what the
        client needs. Raises VariableFailed, RunCancelled, UnknownVariableError, or
        TimeoutError after `timeout` seconds (the run goes on)."""
        if perf not in PRIORITY:
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
        if run.waits.get(name) != "latency" and run.waits.get(name) != perf:
            run.waits[name] = perf
            await self._deduce(run)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)

    async def cancel(self, run_id: str) -> None:
        """Stop a run: its calls stop, their engine contexts are freed, and every pending
        `get` raises RunCancelled. Finished runs are left alone."""
        run = self._run(run_id)
        if run.state != "running":
            return
        run.state = "cancelled"  # no call of this run starts from here on
        for name in list(run.queued):
            self._unqueue(run, name)
        tasks = list(run.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for status in run.calls.values():
            if status.state not in ("finished", "failed"):
                status.state = "cancelled"
        try:
            await self._emit(run, "run_finished", {"status": "cancelled"})
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
            self._unqueue(run, name)
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

    # ------------------------------------------------------------------ state changes
    async def _emit(self, run: Run, type: str, payload: dict[str, Any]) -> Event:
        """Tell the listeners, then log the event (the caller applies the change after)."""
        if not self.listeners:
            return run.log.append(type, payload)
        async with run.lock:  # listeners see a run's events in seq order
            for listener in self.listeners:
                await listener.on_event(run.run_id, type, payload)
            return run.log.append(type, payload)

    async def _deduce(self, run: Run) -> None:
        deduction = deduce_shared(run.program, run.criteria())
        old = run.deduction
        changed = old is None or (old is not deduction and old.calls != deduction.calls)
        if changed:
            await self._emit(run, "objectives", {"calls": deduction.as_json()})
        run.deduction = deduction
        for name, ready in run.queued.items():
            objective, ready.group = run.objective(name)
            if objective != ready.objective and self._pending.get(ready.call_id) is ready:
                self._pending_latency += 1 if objective == "latency" else -1
            ready.objective = objective

    async def _set_value(
        self, run: Run, name: str, value: str, *, source: str, call: str | None
    ) -> None:
        payload = {"name": name, "value": value, "source": source, "call": call}
        if self.listeners:
            await self._emit(run, "variable_ready", payload)
        else:
            run.log.append("variable_ready", payload)
        run.values[name] = value
        run.resolve(name)
        var = run.program.variables.get(name)
        if var is not None:
            self._ready_calls(run, var.consumers)

    async def _fail_calls(self, run: Run, failing: dict[str, str], ran: bool = True) -> None:
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
            self._unqueue(run, name)
            await self._emit(run, "call_failed", {"call": name, "error": reason})
            status.state, status.error = "failed", reason
            why = f"call {name!r} {'failed' if ran else 'not run'}: {reason}"
            for out in run.program.calls[name].outputs:
                if out in run.values or out in run.failed:
                    continue
                await self._emit(run, "variable_failed", {"name": out, "error": why})
                run.failed[out] = why
                run.resolve(out)
                for consumer in run.program.variables[out].consumers:
                    queue.append((consumer, f"input {out!r} failed: {why}", False))
        await self._maybe_finish(run)

    async def _maybe_finish(self, run: Run) -> None:
        if not run.can_finish():
            return
        status = "failed" if any(c.state == "failed" for c in run.calls.values()) else "finished"
        await self._emit(run, "run_finished", {"status": status})
        run.state = status
        run.log.close()

    # ------------------------------------------------------------------ readiness
    def _ready_calls(self, run: Run, names: Sequence[str] | Mapping[str, Any]) -> None:
        """Queue every call among `names` that waits and has all its inputs."""
        if run.state != "running":
            return
        queued = False
        for name in names:
            status = run.calls.get(name)
            if status is None or status.state != "waiting" or not run.inputs_ready(name):
                continue
            status.state = "ready"
            ready = _Ready(f"{run.run_id}/{name}", run, name, self.clock())
            ready.objective, ready.group = run.objective(name)
            self._queue(ready)
            queued = True
        if queued:
            self._wake.set()

    # ------------------------------------------------------------------ dispatch
    async def _dispatch_loop(self) -> None:
        while True:
            if self._pending:
                # pending calls age: look again in a while even if nothing changes
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.policy.aging_s / 2):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            if self._pending:
                try:
                    await self._round()
                except Exception:  # a bug must not stop every run: log, retry next round
                    log.exception("dispatcher round failed")
                    await asyncio.sleep(0.1)
                    self._wake.set()

    async def _round(self) -> None:
        began = time.perf_counter()
        stats = {eid: await self._stats(eid) for eid in self.engines}
        cap = self.config.policy.max_batch
        slots = sum(cap - self._load[eid].batch if st else 0 for eid, st in stats.items())
        ready = self._window(max(0, slots))
        ready = await self._render(ready)
        statics = {r.static_key for r in ready if r.static_key is not None}
        shared = shareable(
            (r.prefixes for r in ready),
            self.sharing.table,
            self.config.static_prefix_min_tokens,
            lambda p: p.key in statics,
        )
        biggest = max(self._capacity.values(), default=1 << 62)
        pending: list[PendingCall] = []
        for r, prefixes in zip(ready, shared, strict=True):
            r.shared = prefixes
            gid = None if r.group is None else f"{r.run.run_id}/{r.group}"
            n = min(r.plan.n_tokens, biggest)  # never more than an empty engine offers
            pending.append(PendingCall(r.call_id, r.objective, n, r.enqueued_at, prefixes, gid))
        needed = sum(c.n_tokens for c in pending)
        keys = {p.key for r in ready for p in r.shared}
        snapshots = [self._snapshot(eid, st, needed, keys) for eid, st in stats.items()]
        for a in schedule(pending, snapshots, self.clock(), self.config.policy):
            r = self._pending.get(a.call_id)
            if r is not None and r.run.state == "running":
                self._unqueue(r.run, r.name, started=True)
                self._start(r, a.engine_id)
        self.round_durations.append(time.perf_counter() - began)

    async def _render(self, ready: list[_Ready]) -> list[_Ready]:
        """Render the calls not rendered yet (`_Ready`); returns those that rendered. A
        call that cannot be rendered fails (with what depends on it)."""
        out: list[_Ready] = []
        failed: list[tuple[_Ready, str]] = []
        model, tokens = self.model, self.tokens
        for r in ready:
            if r.plan is None:
                run = r.run
                call = run.program.calls[r.name]
                try:
                    # the plan and the prefix keys in one pass; each value tokenized once
                    r.plan, prefixes = render_call(call, run.values, tokens, model, run.salt)
                except Exception as exc:  # e.g. a tokenizer giving ids out of range
                    failed.append((r, f"{type(exc).__name__}: {exc}"))
                    continue
                r.prefixes = prefixes
                if prefixes and prefixes[0].n_segments == 1 and isinstance(call.segments[0], Text):
                    r.static_key = prefixes[0].key
            out.append(r)
        for r, error in failed:  # (_fail_calls takes each off the queue)
            await self._fail_calls(r.run, {r.name: f"rendering the call failed: {error}"})
        return out

    def _window(self, slots: int) -> list[_Ready]:
        """The pending calls worth offering to the policy this round.

        At most `max_batch - batch_size` calls fit on each engine (`slots` in all), so when
        more are pending only about that many are offered. Order of choice: aged calls
        (oldest first), then latency calls, then throughput calls; within each kind every
        tenant first gets an equal share of the slots, split equally among its runs (a
        tenant or run with a thousand ready calls does not hold back one with a single
        call), then the oldest fill the rest. A call in a
        task group brings every pending member of its group, and they all count against
        the slots and its run's share: groups are never split. A group that does not fit
        in the slots left is passed over this round (smaller work after it may fill
        them), unless nothing is chosen yet: the first unit in this order is always
        offered whole, even a group larger than all the slots (no starvation: an aged
        call comes first). Without the window a backlog makes every round cost as much as
        the whole backlog. `_pending` is in enqueue order, so the oldest come first.
        """
        pending = self._pending
        if len(pending) <= slots:
            return list(pending.values())
        # each pass below stops once the slots are taken: a round costs in the slots, not
        # in the backlog (the counters say how many runs and latency calls are pending)
        chosen: dict[str, _Ready] = {}
        taken: dict[str, int] = {}  # run id -> calls chosen (a dict: no __missing__ calls)
        by_tenant: dict[str | None, int] = {}  # tenant -> calls chosen
        passed: set[tuple[str, int]] = set()  # groups that did not fit this round

        def take(r: _Ready) -> None:
            """Choose `r`, with its whole task group when it has one, if it fits."""
            tenant = r.run.tenant
            if r.group is None:
                chosen[r.call_id] = r
                taken[r.run.run_id] = taken.get(r.run.run_id, 0) + 1
                by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
                return
            gkey = (r.run.run_id, r.group)
            if gkey in passed:
                return
            members = [
                q
                for q in r.run.queued.values()
                if q.group == r.group and pending.get(q.call_id) is q and q.call_id not in chosen
            ]
            if chosen and len(chosen) + len(members) > slots:
                passed.add(gkey)
                return
            for q in members:
                chosen[q.call_id] = q
            taken[r.run.run_id] = taken.get(r.run.run_id, 0) + len(members)
            by_tenant[tenant] = by_tenant.get(tenant, 0) + len(members)

        old = self.clock() - self.config.policy.aging_s
        for r in pending.values():
            if r.enqueued_at >= old or len(chosen) >= slots:
                break
            if r.call_id not in chosen:
                take(r)
        # fairness: each tenant first gets an equal share of the slots, split equally among
        # its runs, then the oldest fill up
        tenants = self._pending_tenants
        share = max(1, slots // len(tenants))
        for want_latency in (True, False):
            if want_latency:
                if not self._pending_latency:
                    continue
                source: Iterable[_Ready] = [r for r in pending.values() if r.objective == "latency"]
            else:
                source = pending.values()
            for fair in (True, False):
                if len(chosen) >= slots:
                    break
                for r in source:
                    if len(chosen) >= slots:
                        break
                    if (r.objective == "latency") != want_latency or r.call_id in chosen:
                        continue
                    if fair:
                        tenant = r.run.tenant
                        if by_tenant.get(tenant, 0) >= share or taken.get(
                            r.run.run_id, 0
                        ) >= max(1, share // tenants[tenant]):
                            continue
                    take(r)
        return list(chosen.values())

    async def _stats(self, engine_id: str) -> EngineStats | None:
        """The engine's stats, or None when it cannot be reached (it takes no work)."""
        try:
            stats = await self.engines[engine_id].stats()
        except Exception:
            log.warning("engine %s: stats failed; skipping it this round", engine_id)
            return None
        self._capacity[engine_id] = stats.blocks_total * stats.block_size
        return stats

    def _snapshot(
        self, engine_id: str, stats: EngineStats | None, needed: int, keys: set[str]
    ) -> EngineSnapshot:
        """What the policy sees of one engine. Only the prefixes this round's calls have
        are listed, and idle prefixes count as free memory only when the round may need
        them: both would otherwise cost time in the number of prefixes held."""
        if stats is None:
            return EngineSnapshot(engine_id, batch_size=self.config.policy.max_batch)
        load = self._load[engine_id]
        table = self.sharing.table
        free = stats.free_tokens
        if free < needed:
            free += table.evictable_tokens(engine_id)
        held = frozenset(
            k for k in keys if (e := table.get(k)) is not None and e.engine_id == engine_id
        )
        return EngineSnapshot(
            engine_id,
            running_latency=load.latency,
            batch_size=load.batch,
            running_tokens=load.tokens,
            free_kv_tokens=free,
            prefixes=held,
        )

    def _start(self, r: _Ready, engine_id: str) -> None:
        now = self.clock()
        self.dispatch_delays.append(now - r.enqueued_at)
        self.calls_dispatched += 1
        objective, group = r.objective, r.group
        status = r.run.calls[r.name]
        status.state, status.engine = "running", engine_id
        load = self._load[engine_id]
        counted_latency = objective == "latency" and group is None
        load.batch += 1
        load.tokens += r.plan.n_tokens
        load.latency += counted_latency
        task = asyncio.create_task(self._run_call(r, engine_id, objective, group))
        r.run.tasks[r.name] = task

        def done(_: asyncio.Task[None]) -> None:
            load.batch -= 1
            load.tokens -= r.plan.n_tokens
            load.latency -= counted_latency
            self._uncount(self._inflight, r.run.tenant)
            if r.run.tasks.get(r.name) is task:  # a re-dispatched call has a new task
                del r.run.tasks[r.name]
            if self._pending:
                self._wake.set()

        task.add_done_callback(done)

    async def _run_call(
        self, r: _Ready, engine_id: str, objective: Criterion, group: int | None
    ) -> None:
        run, name = r.run, r.name
        priority = PRIORITY[objective]
        runner = CallRunner(self.engines[engine_id], run.salt, priority, self.tokens.value)
        keys: list[str] = []
        error: str | None = None
        try:
            started = {"call": name, "engine": engine_id, "objective": objective, "group": group}
            if self.listeners:
                await self._emit(run, "call_started", started)
            else:  # what `_emit` does without listeners, without a coroutine
                run.log.append("call_started", started)
            # attach first: it pins the prefixes this call uses, so making room for the
            # rest of the call cannot evict them
            if r.shared:
                attached = await self.sharing.attach(
                    engine_id, r.shared, r.plan.prompt, run.salt, priority
                )
            else:  # what attach gives for no prefixes, without its coroutine
                attached = Attached(None, 0)
            keys = attached.keys
            if self.sharing.table.has_idle(engine_id):  # make_room's own first test
                await self.sharing.make_room(engine_id, r.plan.n_tokens - attached.n_tokens)

            async def on_token(step: Step, delta: TokenDelta) -> None:
                await self._emit(
                    run,
                    "token",
                    {
                        "call": name,
                        "variable": step.output,
                        "text": delta.text,
                        "token_id": delta.token_id,
                    },
                )

            async def on_value(step: Step, value: str) -> None:
                await self._set_value(run, step.output, value, source="call", call=name)

            known: dict[str, str] = {}  # outputs recovered (a store's resume) are filled
            values = run.values
            for o in run.program.calls[name].outputs:
                if o in values:
                    known[o] = values[o]
            await runner.run(
                r.plan, attached.context_id, attached.n_tokens, known, on_token, on_value
            )
            finished = {"call": name, "prompt_tokens": len(r.plan.prompt),
                        "completion_tokens": runner.tokens, "finish_reasons": runner.finishes}
        except asyncio.CancelledError:
            await self._cleanup(runner, engine_id, keys)
            raise
        except RunOwnedElsewhere:
            # another manager sharing the store holds this call: the run is theirs
            await self._cleanup(runner, engine_id, keys)
            run.tasks.pop(name, None)
            log.info("run %s is run by another manager; dropping it here", run.run_id)
            await self.abandon(run.run_id)
            return
        except EngineUnavailable:
            # the engine is gone, not the call's fault: retire it and run the call elsewhere
            await self._cleanup(runner, engine_id, keys)
            log.warning("engine %s unavailable; dispatching its calls elsewhere", engine_id)
            run.tasks.pop(name, None)  # this task ends here: not one for remove_engine to cancel
            await self.remove_engine(engine_id)
            self._requeue(run, name)
            return
        except Exception as exc:  # an engine error fails this call only
            error = f"{type(exc).__name__}: {exc}"
        await self._cleanup(runner, engine_id, keys)
        try:
            if error is None:
                if self.listeners:
                    await self._emit(run, "call_finished", finished)
                else:
                    run.log.append("call_finished", finished)
                run.calls[name].state = "finished"
                if run.can_finish():  # (without a coroutine when it cannot)
                    await self._maybe_finish(run)
                return
        except Exception as exc:  # e.g. a listener that cannot record the end
            error = f"{type(exc).__name__}: {exc}"
        try:
            await self._fail_calls(run, {name: error})
        except Exception:  # the failure itself cannot be recorded: keep the state honest
            log.exception("run %s: recording the failure of call %r failed", run.run_id, name)
            run.calls[name].state, run.calls[name].error = "failed", error

    async def _cleanup(self, runner: CallRunner, engine_id: str, keys: list[str]) -> None:
        self.tokens_generated += runner.tokens
        runner.tokens = 0
        try:
            await runner.free()
            if keys:
                await self.sharing.release(engine_id, keys)
        except EngineUnavailable:  # a dead engine holds nothing any more
            log.info("engine %s unavailable during cleanup", engine_id)

    # ------------------------------------------------------------------ helpers
    def _queue(self, ready: _Ready) -> None:
        """Put a ready call on the dispatcher's queue."""
        old = self._pending.pop(ready.call_id, None)
        if old is not None:  # not expected: a call is queued once at a time
            self._count_out(old)
        self._pending[ready.call_id] = ready
        ready.run.queued[ready.name] = ready
        runs = self._pending_runs
        run_id = ready.run.run_id
        n = runs.get(run_id, 0)
        runs[run_id] = n + 1
        tenant = ready.run.tenant
        if not n:
            self._pending_tenants[tenant] = self._pending_tenants.get(tenant, 0) + 1
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        self._pending_latency += ready.objective == "latency"

    def _unqueue(self, run: Run, name: str, started: bool = False) -> None:
        """Take a ready call off the dispatcher's queue (`started`: to run it now)."""
        queued = run.queued.pop(name, None)
        call_id = queued.call_id if queued is not None else f"{run.run_id}/{name}"
        ready = self._pending.pop(call_id, None)
        if ready is not None:
            self._count_out(ready, started)

    def _count_out(self, ready: _Ready, started: bool = False) -> None:
        """Count a call off the queue; `started`: it runs now, so it stays in flight."""
        run_id = ready.run.run_id
        runs = self._pending_runs
        left = runs[run_id] - 1
        tenant = ready.run.tenant
        if left:
            runs[run_id] = left
        else:
            del runs[run_id]
            self._uncount(self._pending_tenants, tenant)
        if not started:
            self._uncount(self._inflight, tenant)
        self._pending_latency -= ready.objective == "latency"

    @staticmethod
    def _uncount(counts: dict[str | None, int], tenant: str | None) -> None:
        left = counts.get(tenant, 0) - 1
        if left > 0:
            counts[tenant] = left
        else:  # (also after `stop` cleared the counts)
            counts.pop(tenant, None)

    def inflight(self, tenant: str | None) -> int:
        """Calls of `tenant` that are ready (queued for an engine) or running."""
        return self._inflight.get(tenant, 0)

    def _check_size(self, n_calls: int, what: str) -> None:
        cap = self.config.max_calls_per_run
        if n_calls > cap:
            raise ProgramError(f"{what} would have {n_calls} calls; a run holds at most {cap}")

    def _check_tenant(self, tenant: str | None, adding: int) -> None:
        cap = self.config.max_calls_per_tenant
        now = self._inflight.get(tenant, 0)
        if adding and now + adding > cap:
            raise TenantBusy(
                f"{now} calls of this tenant are ready or running and {adding} more would "
                f"start (at most {cap} at once); retry when some have finished"
            )

    def _check_limits(self, calls: Iterable[Call]) -> None:
        """Generation configs must fit the model: a bad one would fail only at run time."""
        vocab, context = self._limits
        if vocab is None and context is None:
            return
        problems = [
            f"call {call.name!r}, output {out!r}: {problem}"
            for call in calls
            for out, config in call.configs.items()
            for problem in config.limit_problems(vocab, context)
        ]
        if problems:
            raise ProgramError("; ".join(problems[:5]), problems)

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


def _model_limits(engines: Iterable[EngineClient]) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) every engine accepts; None where none says."""
    vocab = [v for e in engines if isinstance(v := getattr(e, "vocab_size", None), int)]
    context = [n for e in engines if isinstance(n := getattr(e, "max_model_len", None), int)]
    return (min(vocab) if vocab else None, min(context) if context else None)
