"""Claims: readiness, leases, fencing, and concurrent claimers never sharing a call."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from store_helpers import chain_calls, fan_calls, url_text

from parrot_backend.store import Store
from parrot_backend.store.columns import utcnow
from parrot_backend.store.errors import InvalidRequestError, NotFoundError

CLAIMER = Path(__file__).with_name("claimer_proc.py")


def test_only_ready_calls_are_claimed_in_dag_order(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, chain_calls(3), {"x0": "a"}).run.id
    (first,) = store.claim_calls("w", limit=10)
    assert first.call.idx == 0 and first.input_values == {"x0": "a"}
    assert first.call.status == "claimed" and first.call.attempts == 1
    assert first.tenant_id == tenant
    assert store.claim_calls("w", limit=10) == []  # c1 waits for x1
    assert store.mark_call_started(first.call.id, "w", engine="e0") is True
    assert store.mark_call_first_token(first.call.id, "w") is True
    result = store.finish_call(
        first.call.id,
        "w",
        {"x1": "b"},
        prompt_tokens=5,
        completion_tokens=7,
        events=[("variable", {"name": "x1"})],
    )
    assert result.accepted and result.changed == ("x1",) and result.seqs == (1,)
    (second,) = store.claim_calls("w", limit=10)
    assert second.call.idx == 1 and second.input_values == {"x1": "b"}
    done = store.get_run(tenant, run).calls[0]
    assert (done.status, done.engine, done.prompt_tokens, done.completion_tokens) == (
        "done",
        "e0",
        5,
        7,
    )
    assert done.queued_at <= done.started_at <= done.first_token_at <= done.finished_at


def test_latency_calls_first_and_cancelled_runs_skipped(store: Store, tenant: int) -> None:
    calls = fan_calls(3)
    calls[2]["objective"] = "latency"
    run = store.create_run(tenant, {}, calls, {"q": "?"}).run.id
    other = store.create_run(tenant, {}, fan_calls(2), {"q": "?"}).run.id
    claimed = store.claim_calls("w", limit=2)
    assert [c.call.idx for c in claimed] == [2, 0]
    store.cancel_run(tenant, other)
    rest = store.claim_calls("w", limit=10)
    assert [(c.call.run_id, c.call.idx) for c in rest] == [(run, 1)]


def test_expired_lease_is_reclaimable_and_stale_worker_fenced(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, chain_calls(1), {"x0": "a"}).run.id
    t0 = utcnow()
    (a,) = store.claim_calls("A", lease_s=10, now=t0)
    assert store.claim_calls("B", now=t0 + timedelta(seconds=5)) == []
    assert store.renew_lease("A", [a.call.id], lease_s=10, now=t0 + timedelta(seconds=5)) == [
        a.call.id
    ]
    assert store.claim_calls("B", now=t0 + timedelta(seconds=12)) == []  # renewed to t0+15
    (b,) = store.claim_calls("B", now=t0 + timedelta(seconds=16))
    assert b.call.id == a.call.id and b.call.attempts == 2 and b.call.claimed_by == "B"
    # A lost its claim: nothing it records is accepted.
    assert store.mark_call_started(a.call.id, "A") is False
    assert store.renew_lease("A", [a.call.id]) == []
    assert store.finish_call(a.call.id, "A", {"x1": "from A"}).accepted is False
    assert store.fail_call(a.call.id, "A", "boom") is False
    assert store.finish_call(b.call.id, "B", {"x1": "from B"}).accepted is True
    assert store.get_variable(tenant, run, "x1").value == "from B"
    # Recording twice is refused: the output is recorded once.
    assert store.finish_call(b.call.id, "B", {"x1": "again"}).accepted is False
    assert store.get_variable(tenant, run, "x1").value == "from B"


def test_ready_output_is_never_overwritten_by_a_rerun(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, chain_calls(1), {"x0": "a"}).run.id
    # A client (or an earlier attempt) already produced x1; the call still completes.
    assert store.set_variable(run, "x1", "first") is True
    (c,) = store.claim_calls("w")
    result = store.finish_call(c.call.id, "w", {"x1": "second"})
    assert result.accepted and result.changed == ()
    assert store.get_variable(tenant, run, "x1").value == "first"


def test_release_and_fail(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(3), {"q": "?"}).run.id
    t0 = utcnow()
    held = store.claim_calls("dead", limit=3, lease_s=1, now=t0)
    assert len(held) == 3
    assert store.release_expired_claims(now=t0) == 0
    assert store.release_expired_claims(now=t0 + timedelta(seconds=2)) == 3
    again = store.claim_calls("alive", limit=3)
    assert store.release_worker_claims("alive") == 3
    again = store.claim_calls("alive", limit=3)
    assert [c.call.attempts for c in again] == [3, 3, 3]
    assert store.fail_call(again[0].call.id, "alive", "oom", retry=True) is True
    assert store.fail_call(again[1].call.id, "alive", "bad prompt") is True
    detail = store.get_run(tenant, run)
    assert [c.status for c in detail.calls] == ["pending", "failed", "claimed"]
    assert detail.variables["a1"].status == "failed" and detail.calls[1].error == "bad prompt"


def _drain(store: Store, worker: str, seen: list[int]) -> None:
    idle = 0
    while idle < 3:
        claimed = store.claim_calls(worker, limit=2, lease_s=60)
        if not claimed:
            idle += 1
            time.sleep(0.005)
            continue
        idle = 0
        for c in claimed:
            seen.append(c.call.id)
            assert store.finish_call(c.call.id, worker, {c.call.outputs[0]: worker}).accepted


def _check_exclusive(store: Store, tenant: int, run: str, claims: dict[str, list[int]]) -> None:
    everyone = [i for ids in claims.values() for i in ids]
    detail = store.get_run(tenant, run)
    assert sorted(everyone) == sorted(c.id for c in detail.calls)  # each call claimed once
    assert all(c.status == "done" and c.attempts == 1 for c in detail.calls)
    for worker, ids in claims.items():
        for call in detail.calls:
            if call.id in ids:
                assert detail.variables[call.outputs[0]].value == worker


def test_threads_never_claim_the_same_call(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(60), {"q": "?"}).run.id
    claims: dict[str, list[int]] = {f"w{i}": [] for i in range(4)}
    threads = [threading.Thread(target=_drain, args=(store, w, ids)) for w, ids in claims.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check_exclusive(store, tenant, run, claims)


def test_processes_never_claim_the_same_call(
    store: Store, tenant: int, db_url: URL, tmp_path: Path
) -> None:
    n = 80
    run = store.create_run(tenant, {}, fan_calls(n), {"q": "?"}).run.id
    go = tmp_path / "go"
    procs = {
        w: subprocess.Popen(
            [sys.executable, str(CLAIMER), url_text(db_url), w, str(go), str(tmp_path / w)]
        )
        for w in ("p1", "p2")
    }
    # Both processes are started (imports done, waiting on the file) before the race begins.
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"{w}.ready").exists() for w in procs):
        assert time.monotonic() < deadline, "claimer processes did not start"
        time.sleep(0.02)
    go.touch()
    for p in procs.values():
        assert p.wait(timeout=60) == 0
    claims = {w: json.loads((tmp_path / w).read_text()) for w in procs}
    _check_exclusive(store, tenant, run, claims)
    assert all(claims.values()), f"one process got no call: {[len(v) for v in claims.values()]}"


@pytest.mark.parametrize("limit", [1, 5])
def test_claim_limit(store: Store, tenant: int, limit: int) -> None:
    store.create_run(tenant, {}, fan_calls(7), {"q": "?"})
    assert len(store.claim_calls("w", limit=limit)) == limit


def test_pg_claim_skips_rows_locked_by_another_claimer(store: Store, tenant: int) -> None:
    if store.dialect != "postgresql":
        pytest.skip("row locks are a PostgreSQL feature (SQLite has one writer at a time)")
    store.create_run(tenant, {}, fan_calls(2), {"q": "?"})
    first_id = min(c.id for c in store.unfinished_runs()[0].calls)
    with store.engine.connect() as other:
        # Another manager is in the middle of claiming the first call (row locked).
        other.execute(text("SELECT id FROM calls WHERE id = :i FOR UPDATE"), {"i": first_id})
        start = time.monotonic()
        (got,) = store.claim_calls("w", limit=2)
        assert got.call.id != first_id and time.monotonic() - start < 5  # skipped, not waited
        other.rollback()
    (rest,) = store.claim_calls("w", limit=2)
    assert rest.call.id == first_id


def test_finish_call_records_first_token_and_keeps_an_earlier_one(
    store: Store, tenant: int
) -> None:
    run = store.create_run(tenant, {}, fan_calls(2), {"q": "?"}).run.id
    a, b = sorted(store.claim_calls("w", limit=2), key=lambda c: c.call.idx)
    first = utcnow() - timedelta(seconds=5)
    assert store.finish_call(a.call.id, "w", {"a0": "x"}, first_token_at=first).accepted
    assert store.mark_call_started(b.call.id, "w") is True
    assert store.mark_call_first_token(b.call.id, "w") is True
    marked = store.get_run(tenant, run).calls[1].first_token_at
    assert store.finish_call(b.call.id, "w", {}, completion_tokens=3).accepted  # none given
    calls = store.get_run(tenant, run).calls
    assert abs(calls[0].first_token_at - first) < timedelta(milliseconds=1)
    assert calls[1].first_token_at == marked and calls[1].completion_tokens == 3
    assert store.get_run(tenant, run).variables["a1"].status == "pending"  # {} sets nothing
    with pytest.raises(NotFoundError):
        store.finish_call(10**9, "w", {})
    assert not store.finish_call(a.call.id, "w", {}).accepted  # already done


def test_finish_call_rejects_foreign_outputs_and_writes_nothing(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(1), {"q": "?"}).run.id
    (c,) = store.claim_calls("w")
    with pytest.raises(InvalidRequestError):
        store.finish_call(c.call.id, "w", {"a0": "x", "q": "forged"})
    detail = store.get_run(tenant, run)
    assert detail.calls[0].status == "claimed" and detail.variables["a0"].status == "pending"
    assert detail.variables["q"].value == "?"


def test_hold_call_claims_and_fences(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(1), {"q": "?"}).run.id
    call_id = store.get_run(tenant, run).calls[0].id
    assert store.hold_call(call_id, "w1", engine="e0", events=[("started", {})]) is True
    assert store.hold_call(call_id, "w2", events=[("started", {})]) is False  # w1 holds it
    assert store.hold_call(call_id, "w1", engine="e1") is True  # its holder may restart it
    held = store.get_run(tenant, run).calls[0]
    assert (held.status, held.claimed_by, held.engine, held.attempts) == ("running", "w1", "e1", 2)
    assert [e.type for e in store.read_events(tenant, run)] == ["started"]
    assert store.hold_call(10**9, "w1") is False


def test_batch_commits_together_or_not_at_all(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(2), {"q": "?"}).run.id
    ids = [c.id for c in store.get_run(tenant, run).calls]
    with store.batch():
        assert store.hold_call(ids[0], "w", events=[("started", {})])
        assert store.set_run_status(run, "running")
        assert store.set_variables(run, {"a0": "x"}, events=[("ready", {})]) == ["a0"]
        with pytest.raises(NotFoundError):  # a failing member undoes only itself
            store.set_variables(run, {"nope": "v"}, events=[("ready", {})])
    detail = store.get_run(tenant, run)
    assert detail.run.status == "running" and detail.variables["a0"].value == "x"
    assert [e.type for e in store.read_events(tenant, run)] == ["started", "ready"]
    with pytest.raises(RuntimeError, match="boom"), store.batch():
        store.hold_call(ids[1], "w", events=[("started", {})])
        store.set_variables(run, {"a1": "y"})
        raise RuntimeError("boom")
    detail = store.get_run(tenant, run)
    assert detail.calls[1].status == "pending" and detail.variables["a1"].status == "pending"
    assert [e.type for e in store.read_events(tenant, run)] == ["started", "ready"]
    with pytest.raises(RuntimeError, match="nest"), store.batch(), store.batch():
        pass


def test_set_variables_checks_tenant_and_takes_new_names_on_open_runs(store: Store) -> None:
    a, _ = store.create_tenant("a")
    b, _ = store.create_tenant("b")
    run = store.create_run(a.id, {}, fan_calls(1), open=True).run.id
    with pytest.raises(NotFoundError):
        store.set_variables(run, {"q": "forged"}, tenant_id=b.id)
    assert store.get_variable(a.id, run, "q").status == "pending"
    assert store.set_variables(
        run, {"late": "1", "q": "?"}, tenant_id=a.id, events=[("set", {})]
    ) == ["late", "q"]
    assert store.set_variables(run, {"late": "2", "q": "!"}, events=[("set", {})]) == []
    assert store.get_variable(a.id, run, "late").value == "1"
    assert [e.type for e in store.read_events(a.id, run)] == ["set"]
    with pytest.raises(NotFoundError):
        store.set_variables("no-such-run", {"q": "x"})


def test_settle_calls_records_lost_ends_of_calls_whose_outputs_are_set(
    store: Store, tenant: int
) -> None:
    run = store.create_run(tenant, {}, fan_calls(3), {"q": "?"}).run.id
    ids = [c.id for c in store.get_run(tenant, run).calls]
    assert store.hold_call(ids[0], "w1")  # a0 set, end lost; the claim is w1's own
    assert store.set_variables(run, {"a0": "x", "a1": "y"}) == ["a0", "a1"]
    assert store.hold_call(ids[1], "w2")  # another worker's live claim: left alone
    assert store.settle_calls(run, "w1") == ["f0"]
    calls = store.get_run(tenant, run).calls
    assert [c.status for c in calls] == ["done", "running", "pending"]  # f2: a2 not set
    assert [e.payload for e in store.read_events(tenant, run)] == [
        {"call": "f0", "recovered": True}
    ]
    assert store.settle_calls(run, "w1") == []  # nothing left to settle


def test_batch_without_savepoints_is_all_or_nothing(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, {}, fan_calls(2), {"q": "?"}).run.id
    ids = [c.id for c in store.get_run(tenant, run).calls]
    with store.batch(savepoints=False):
        assert store.hold_call(ids[0], "w", events=[("started", {})])
        assert store.set_variables(run, {"a0": "x"}, events=[("ready", {})]) == ["a0"]
    assert [e.type for e in store.read_events(tenant, run)] == ["started", "ready"]
    with pytest.raises(RuntimeError, match="nothing was written"), store.batch(savepoints=False):
        assert store.hold_call(ids[1], "w", events=[("started", {})])
        with pytest.raises(NotFoundError):  # caught, but the batch is spoiled
            store.set_variables(run, {"nope": "v"})
    detail = store.get_run(tenant, run)
    assert detail.calls[1].status == "pending"
    assert [e.type for e in store.read_events(tenant, run)] == ["started", "ready"]


def test_get_variables_reads_a_runs_variables_as_get_variable_does(store: Store) -> None:
    a, _ = store.create_tenant("a")
    b, _ = store.create_tenant("b")
    run = store.create_run(a.id, {}, chain_calls(2), {"x0": "a"}).run.id
    store.set_variables(run, {"x1": "b"})
    got = store.get_variables(a.id, run)
    assert set(got) == {"x0", "x1", "x2"}
    for name, record in got.items():
        assert record == store.get_variable(a.id, run, name)
    assert (got["x1"].status, got["x1"].value, got["x2"].status) == ("ready", "b", "pending")
    with pytest.raises(NotFoundError):
        store.get_variables(b.id, run)  # another tenant's run looks missing
    with pytest.raises(NotFoundError):
        store.get_variables(a.id, "no-such-run")
