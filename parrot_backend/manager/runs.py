"""The state of one run: variable values, call states, waits, and the errors clients see."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from parrot_backend.program import Criterion, Program

from .events import EventLog
from .objectives import Deduction

CallState = Literal["waiting", "ready", "running", "finished", "failed", "cancelled"]
RunPhase = Literal["running", "finished", "failed", "cancelled"]
TERMINAL_CALL_STATES = frozenset({"finished", "failed", "cancelled"})


class RunNotFound(KeyError):
    """No run with this id (never created, or forgotten)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "run not found"


class RunClosedError(ValueError):
    """The run is closed (or over): it accepts no more calls or inputs."""


class InputAlreadySet(ValueError):
    """An input of the run already has a value (an input is set once)."""


class VariableFailed(RuntimeError):
    """The variable will never get a value: its call, or one upstream, failed."""

    def __init__(self, run_id: str, name: str, reason: str) -> None:
        super().__init__(f"run {run_id}: variable {name!r} failed: {reason}")
        self.run_id = run_id
        self.name = name
        self.reason = reason


class RunCancelled(RuntimeError):
    """The run was cancelled before the variable got a value."""


class TenantBusy(RuntimeError):
    """The tenant already has as many calls ready or running as it may (its fair share of
    the engines): the run or calls were not admitted; retry once some have finished."""


class RunOwnedElsewhere(RuntimeError):
    """Raised by a listener: another manager (sharing the store) runs this run's calls, so
    this manager drops its copy of the run without recording anything."""


@dataclass(slots=True)
class CallStatus:
    """One call as `run_status` reports it."""

    state: CallState
    engine: str | None = None
    error: str | None = None


@dataclass(slots=True)
class RunStatus:
    """A snapshot of a run for clients and the server."""

    run_id: str
    state: RunPhase
    open: bool
    tenant: str | None
    calls: dict[str, CallStatus]
    values: dict[str, str]
    failed: dict[str, str]
    pending: list[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run_id": self.run_id,
            "state": self.state,
            "open": self.open,
            "tenant": self.tenant,
            "calls": {
                n: {"state": c.state, "engine": c.engine, "error": c.error}
                for n, c in self.calls.items()
            },
            "values": dict(self.values),
            "failed": dict(self.failed),
            "pending": list(self.pending),
        }


@dataclass(slots=True)
class Run:
    """Mutable state of one run, owned by the manager's event loop."""

    run_id: str
    program: Program
    tenant: str | None
    salt: str | None  # prefix-key salt; None only for public programs
    open: bool
    outputs: dict[str, Criterion]
    log: EventLog
    values: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # variable -> reason
    calls: dict[str, CallStatus] = field(default_factory=dict)
    waits: dict[str, Criterion] = field(default_factory=dict)  # from get(perf=...)
    # a client stated a criterion (outputs when created or with added calls, or a get
    # with perf): a get with no perf then leaves the objectives alone
    stated: bool = False
    futures: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # running calls
    queued: dict[str, Any] = field(default_factory=dict)  # ready calls the dispatcher holds
    deduction: Deduction | None = None
    state: RunPhase = "running"
    finishing: bool = False  # its run_finished is being recorded (`maybe_finish`)
    _lock: asyncio.Lock | None = field(default=None, init=False, repr=False)
    _mutex: asyncio.Lock | None = field(default=None, init=False, repr=False)
    # values waiting to be told to the listeners together (`RunTransitions.set_value`)
    value_outbox: list[tuple[dict[str, Any], asyncio.Future[None]]] = field(
        default_factory=list, init=False, repr=False
    )

    @property
    def lock(self) -> asyncio.Lock:
        """Orders listener calls (made on first use: runs without listeners never need it)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @property
    def mutex(self) -> asyncio.Lock:
        """Held by a client's change to an open run (calls added, an input set, closed)
        from its checks to its last event: two changes racing (two values for one input,
        a close beside a value or a call) take effect one after the other, as if sent in
        turn. Made on first use."""
        if self._mutex is None:
            self._mutex = asyncio.Lock()
        return self._mutex

    def criteria(self) -> dict[str, Criterion]:
        """Every wait that objective deduction should see: declared outputs and `get`s
        (latency wins), restricted to variables the program has so far."""
        out: dict[str, Criterion] = {}
        for source in (self.outputs, self.waits):
            for name, crit in source.items():
                if name in self.program.variables and out.get(name) != "latency":
                    out[name] = crit
        return out

    def criterion(self, name: str) -> Criterion | None:
        """What clients wait for `name` with so far (a declared output or a wait; latency
        wins), or None."""
        declared, waited = self.outputs.get(name), self.waits.get(name)
        if declared == "latency" or waited == "latency":
            return "latency"
        return declared or waited

    def objective(self, call: str) -> tuple[Criterion, int | None]:
        """The deduced objective and task group of `call`."""
        if self.deduction is None or call not in self.deduction.calls:
            return "throughput", None
        found = self.deduction.calls[call]
        return found.objective, found.group

    def inputs_ready(self, call: str) -> bool:
        """Whether every variable `call` reads has a value."""
        values = self.values
        for v in self.program.calls[call].inputs:  # a loop: no generator per check
            if v not in values:
                return False
        return True

    def resolve(self, name: str) -> None:
        """Wake `get()` waiters of `name` (its value or failure is already recorded)."""
        fut = self.futures.pop(name, None)
        if fut is None or fut.done():
            return
        if name in self.values:
            fut.set_result(self.values[name])
        else:
            fut.set_exception(VariableFailed(self.run_id, name, self.failed[name]))

    def end_waits(self, reason: str) -> None:
        """Fail every `get()` still waiting with RunCancelled(reason) and close the log."""
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(RunCancelled(reason))
                fut.exception()  # a waiter may have timed out: no "never retrieved"
        self.futures.clear()
        self.log.close()

    def all_calls_done(self) -> bool:
        """Whether no call can still change a variable."""
        for c in self.calls.values():  # a loop: no generator per check
            if c.state not in TERMINAL_CALL_STATES:
                return False
        return True

    def can_finish(self) -> bool:
        """Whether the run should end now: closed, still running, and no call can still
        change a variable."""
        return not self.open and self.state == "running" and self.all_calls_done()

    def status(self) -> RunStatus:
        """A snapshot (copies, safe to hand out)."""
        pending = [
            n for n in self.program.variables if n not in self.values and n not in self.failed
        ]
        return RunStatus(
            self.run_id,
            self.state,
            self.open,
            self.tenant,
            {n: CallStatus(c.state, c.engine, c.error) for n, c in self.calls.items()},
            dict(self.values),
            dict(self.failed),
            pending,
        )
