"""The per-run event log: monotonic seqs, reads after an id, batching, retention."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from store_helpers import chain_calls

from parrot_backend.store import NotFoundError, Store
from parrot_backend.store.columns import utcnow


def _run(store: Store, tenant: int) -> str:
    return store.create_run(tenant, {}, chain_calls(1), {"x0": "v"}).run.id


def test_seq_monotonic_and_read_after(store: Store, tenant: int) -> None:
    run = _run(store, tenant)
    assert store.last_event_seq(run) == 0
    assert store.append_event(run, "start", {"a": 1}) == 1
    assert store.append_events([(run, "tok", {"i": i}) for i in range(5)]) == [2, 3, 4, 5, 6]
    assert store.last_event_seq(run) == 6
    events = store.read_events(tenant, run)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert events[0].payload == {"a": 1} and events[3].payload == {"i": 2}
    # Last-Event-ID: 3 -> exactly the events after it, limited and resumable.
    page = store.read_events(tenant, run, after_seq=3, limit=2)
    assert [e.seq for e in page] == [4, 5]
    assert [e.seq for e in store.read_events(tenant, run, after_seq=page[-1].seq)] == [6]
    assert store.read_events(tenant, run, after_seq=6) == []


def test_batch_across_runs_keeps_order_per_run(store: Store, tenant: int) -> None:
    a, b = _run(store, tenant), _run(store, tenant)
    store.append_event(b, "x")
    seqs = store.append_events([(a, "t", 1), (b, "t", 2), (a, "t", 3), (b, "t", 4)])
    assert seqs == [1, 2, 2, 3]
    assert [e.payload for e in store.read_events(tenant, a)] == [1, 3]
    assert [e.payload for e in store.read_events(tenant, b)] == [None, 2, 4]
    with pytest.raises(NotFoundError):
        store.append_events([(a, "t", 5), ("missing", "t", 6)])
    assert store.last_event_seq(a) == 2  # the failed batch left nothing behind


def test_concurrent_appenders_get_distinct_gapless_seqs(store: Store, tenant: int) -> None:
    run = _run(store, tenant)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(10):
                store.append_events([(run, "tok", {"w": w, "i": i, "k": k}) for k in range(3)])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    events = store.read_events(tenant, run, limit=10_000)
    assert [e.seq for e in events] == list(range(1, 121))
    # A batch is contiguous: its three events got consecutive seqs.
    for first in range(0, 120, 3):
        batch = events[first : first + 3]
        assert {(e.payload["w"], e.payload["i"]) for e in batch} == {
            (batch[0].payload["w"], batch[0].payload["i"])
        }
        assert [e.payload["k"] for e in batch] == [0, 1, 2]


def test_retention_only_touches_finished_runs(store: Store, tenant: int) -> None:
    old, recent, live = _run(store, tenant), _run(store, tenant), _run(store, tenant)
    for run in (old, recent, live):
        store.append_events([(run, "tok", i) for i in range(10)])
    for run in (old, recent):
        store.set_run_status(run, "done")
    later = utcnow() + timedelta(days=10)
    # Events of finished runs written 10 days "ago" go; the live run keeps everything.
    assert store.prune_events(older_than_days=7, now=later) == 20
    assert store.read_events(tenant, old) == [] and len(store.read_events(tenant, live)) == 10
    for run in (old, recent):
        store.append_events([(run, "tok", i) for i in range(10)])
    assert store.prune_events(keep_last=3) == 14
    assert [e.seq for e in store.read_events(tenant, old)] == [18, 19, 20]
    assert len(store.read_events(tenant, live)) == 10
    assert store.append_event(old, "late") == 21  # seqs never restart after pruning
