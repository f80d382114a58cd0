"""The ready queue without a manager: its counts follow the calls queued, started and ended."""

from __future__ import annotations

from parrot_backend.manager.dispatch_window import dispatch_window
from parrot_backend.manager.events import EventLog
from parrot_backend.manager.ready_queue import ReadyCall, ReadyQueue
from parrot_backend.manager.runs import Run
from parrot_backend.program import Program


def _run(run_id: str, tenant: str | None = None) -> Run:
    return Run(run_id, Program(), tenant, "t:", True, {}, EventLog(run_id))


def _call(run: Run, name: str, at: float = 0.0, objective="throughput") -> ReadyCall:
    return ReadyCall(f"{run.run_id}/{name}", run, name, at, objective)


def test_queued_calls_are_counted_per_run_tenant_and_objective() -> None:
    q = ReadyQueue()
    a, b = _run("a", "alice"), _run("b", "alice")
    q.add(_call(a, "x", objective="latency"))
    q.add(_call(a, "y"))
    q.add(_call(b, "z"))
    assert len(q) == 3 and list(q.calls) == ["a/x", "a/y", "b/z"]  # enqueue order
    assert (q.runs, q.tenants, q.inflight, q.latency) == (
        {"a": 2, "b": 1},
        {"alice": 2},
        {"alice": 3},
        1,
    )
    assert set(a.queued) == {"x", "y"}
    q.remove(a, "x")
    q.remove(a, "y")
    assert (q.runs, q.tenants, q.inflight, q.latency) == ({"b": 1}, {"alice": 1}, {"alice": 1}, 0)
    assert a.queued == {}


def test_a_started_call_stays_in_flight_until_it_ends() -> None:
    q = ReadyQueue()
    run = _run("r", "bob")
    q.add(_call(run, "x"))
    q.remove(run, "x", started=True)
    assert not q.calls and q.runs == {} and q.tenants == {}
    assert q.inflight == {"bob": 1}  # running: admission still counts it
    q.ended("bob")
    assert q.inflight == {}


def test_a_new_objective_moves_the_latency_count_only_for_queued_calls() -> None:
    q = ReadyQueue()
    run = _run("r")
    queued, gone = _call(run, "x"), _call(run, "y")
    q.add(queued)
    q.add(gone)
    q.remove(run, "y")
    q.set_objective(queued, "latency", 3)
    q.set_objective(gone, "latency", None)
    assert q.latency == 1 and (queued.objective, queued.group) == ("latency", 3)
    q.set_objective(queued, "throughput", None)
    assert q.latency == 0


def test_clear_forgets_every_count() -> None:
    q = ReadyQueue()
    run = _run("r", "carol")
    q.add(_call(run, "x", objective="latency"))
    q.remove(run, "x", started=True)
    q.add(_call(run, "y"))
    q.clear()
    assert (len(q), q.runs, q.tenants, q.inflight, q.latency) == (0, {}, {}, {}, 0)
    q.ended("carol")  # a call that ends after the clear changes nothing
    assert q.inflight == {}


def test_the_window_offers_everything_when_the_slots_suffice() -> None:
    q = ReadyQueue()
    run = _run("r")
    calls = [_call(run, f"c{i}", at=float(i)) for i in range(5)]
    for c in calls:
        q.add(c)
    assert dispatch_window(q, 5, old=0.0) == calls
    assert len(dispatch_window(q, 2, old=0.0)) == 2
