"""The ready queue: calls whose inputs all have values, waiting for an engine.

Pure bookkeeping (no engines, no event loop): the dispatcher takes calls from it through
the dispatch window (`dispatch_window.py`), admission reads how many calls a tenant has in
flight. It keeps the counts the window reads, so that a round costs in the slots it fills
and not in the backlog: queued calls per run, runs with queued calls per tenant, queued
latency calls, and calls per tenant that are queued or running.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot_backend.program import Criterion

from .prefix import Prefix
from .render import CallPlan
from .runs import Run


@dataclass(slots=True)
class ReadyCall:
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
    objective: Criterion = "throughput"  # kept current by the deduction (`set_objective`)
    group: int | None = None  # its task group in the run, if any
    plan: CallPlan | None = None  # set when the dispatcher renders it
    prefixes: tuple[Prefix, ...] = ()
    static_key: str | None = None
    shared: tuple[Prefix, ...] = ()


class ReadyQueue:
    """Ready calls in enqueue order (`calls`, by call id), and the counts kept with them.

    A call is queued once at a time; its run's `queued` maps its name to it while it is.
    """

    def __init__(self) -> None:
        self.calls: dict[str, ReadyCall] = {}  # by call id, in enqueue order
        self.runs: dict[str, int] = {}  # run id -> its calls in `calls`
        self.tenants: dict[str | None, int] = {}  # tenant -> its runs with calls in `calls`
        self.inflight: dict[str | None, int] = {}  # tenant -> calls queued or running
        self.latency = 0  # calls in `calls` whose objective is latency

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, ready: ReadyCall) -> None:
        """Queue a ready call."""
        old = self.calls.pop(ready.call_id, None)
        if old is not None:  # not expected: a call is queued once at a time
            self._count_out(old)
        self.calls[ready.call_id] = ready
        ready.run.queued[ready.name] = ready
        runs = self.runs
        run_id = ready.run.run_id
        n = runs.get(run_id, 0)
        runs[run_id] = n + 1
        tenant = ready.run.tenant
        if not n:
            self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
        self.latency += ready.objective == "latency"

    def remove(self, run: Run, name: str, started: bool = False) -> None:
        """Take a call of `run` off the queue (`started`: to run it now, so it stays in
        flight until `ended`)."""
        queued = run.queued.pop(name, None)
        call_id = queued.call_id if queued is not None else f"{run.run_id}/{name}"
        ready = self.calls.pop(call_id, None)
        if ready is not None:
            self._count_out(ready, started)

    def set_objective(self, ready: ReadyCall, objective: Criterion, group: int | None) -> None:
        """A new deduction gave the call this objective and task group."""
        if objective != ready.objective and self.calls.get(ready.call_id) is ready:
            self.latency += 1 if objective == "latency" else -1
        ready.objective, ready.group = objective, group

    def ended(self, tenant: str | None) -> None:
        """A call of `tenant` that was started (`remove(..., started=True)`) ended."""
        _uncount(self.inflight, tenant)

    def clear(self) -> None:
        """Forget every call and count (the runs' `queued` are the caller's to clear)."""
        self.calls.clear()
        self.runs.clear()
        self.tenants.clear()
        self.inflight.clear()
        self.latency = 0

    def _count_out(self, ready: ReadyCall, started: bool = False) -> None:
        run_id = ready.run.run_id
        runs = self.runs
        left = runs[run_id] - 1
        tenant = ready.run.tenant
        if left:
            runs[run_id] = left
        else:
            del runs[run_id]
            _uncount(self.tenants, tenant)
        if not started:
            _uncount(self.inflight, tenant)
        self.latency -= ready.objective == "latency"


def _uncount(counts: dict[str | None, int], tenant: str | None) -> None:
    left = counts.get(tenant, 0) - 1
    if left > 0:
        counts[tenant] = left
    else:  # (also after `clear`)
        counts.pop(tenant, None)
