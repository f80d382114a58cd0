"""Runs, variables, workflows and tenants through the Store (SQLite and PostgreSQL)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from store_helpers import chain_calls

from parrot_backend.store import InvalidRequestError, NotFoundError, Store
from parrot_backend.store.models import ApiKey

PROGRAM = {"calls": [{"template": "{{input:x0}} -> {{output:x1}}"}], "public": False}


def test_tenant_keys_are_hashed_and_revocable(store: Store) -> None:
    tenant, key = store.create_tenant("acme")
    assert store.tenant_for_key(key) == tenant
    assert store.tenant_for_key(key + "x") is None
    second = store.create_api_key(tenant.id)
    assert second != key and store.tenant_for_key(second) == tenant
    with store._read() as s:
        stored = [(k.key_hash, k.prefix) for k in s.scalars(select(ApiKey))]
    assert len(stored) == 2
    assert all(key not in h and second not in h for h, _ in stored)
    assert store.revoke_api_key(key) is True
    assert store.revoke_api_key(key) is False
    assert store.tenant_for_key(key) is None
    assert store.tenant_for_key(second) == tenant
    with pytest.raises(InvalidRequestError):
        store.create_tenant("acme")
    assert store.ensure_tenant("acme").id == tenant.id
    assert store.ensure_tenant("other").id != tenant.id


def test_workflow_versions_and_isolation(store: Store) -> None:
    a, _ = store.create_tenant("a")
    b, _ = store.create_tenant("b")
    v1 = store.register_workflow(a.id, "summarize", {"v": 1})
    v2 = store.register_workflow(a.id, "summarize", {"v": 2}, public=True)
    other = store.register_workflow(b.id, "summarize", {"v": "b"})
    assert (v1.version, v2.version, other.version) == (1, 2, 1)
    assert store.get_workflow(a.id, "summarize").program == {"v": 2}
    assert store.get_workflow(a.id, "summarize", 1).program == {"v": 1}
    assert store.get_workflow(a.id, "summarize").public is True
    assert [w.version for w in store.list_workflows(a.id)] == [1, 2]
    assert [w.program for w in store.list_workflows(b.id)] == [{"v": "b"}]
    with pytest.raises(NotFoundError):
        store.get_workflow(a.id, "summarize", 3)
    with pytest.raises(NotFoundError):
        store.get_workflow(b.id, "missing")


def test_concurrent_registrations_of_a_workflow_take_every_version_once(store: Store) -> None:
    """On PostgreSQL, 40 registrations at once ran out of retries on version collisions
    (a 500 for 8 of them); they now queue on the tenant's row."""
    import threading

    a, _ = store.create_tenant("a")
    got, errors = [], []

    def register(i: int) -> None:
        try:
            got.append(store.register_workflow(a.id, "busy", {"i": i}).version)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(got) == list(range(1, 17))
    assert sorted(w.program["i"] for w in store.list_workflows(a.id, "busy")) == list(range(16))


def test_create_run_builds_variables_calls_and_detail(store: Store, tenant: int) -> None:
    calls = chain_calls(2)
    calls[1]["objective"] = "latency"
    calls[1]["task_group"] = "g1"
    detail = store.create_run(tenant, PROGRAM, calls, {"x0": "hello"}, {"x2": "latency"})
    assert detail.run.status == "pending" and detail.run.objectives == {"x2": "latency"}
    assert {n: v.status for n, v in detail.variables.items()} == {
        "x0": "ready",
        "x1": "pending",
        "x2": "pending",
    }
    assert detail.variables["x0"].value == "hello" and detail.variables["x0"].producer_call is None
    assert detail.variables["x2"].producer_call == 1
    assert [(c.idx, c.inputs, c.outputs, c.status) for c in detail.calls] == [
        (0, ("x0",), ("x1",), "pending"),
        (1, ("x1",), ("x2",), "pending"),
    ]
    assert detail.task_groups == {"g1": [1]}
    again = store.get_run(tenant, detail.run.id)
    assert again.program == PROGRAM and again.inputs == {"x0": "hello"}
    assert again.calls[1].objective == "latency" and again.calls[0].queued_at is not None


def test_bad_dags_are_rejected(store: Store, tenant: int) -> None:
    two_producers = [{"inputs": [], "outputs": ["y"]}, {"inputs": [], "outputs": ["y"]}]
    with pytest.raises(InvalidRequestError):
        store.create_run(tenant, PROGRAM, two_producers)
    with pytest.raises(InvalidRequestError):
        store.create_run(tenant, PROGRAM, [{"inputs": [], "outputs": ["x"]}], {"x": "1"})
    with pytest.raises(InvalidRequestError):
        store.create_run(tenant, PROGRAM, [{"inputs": "x", "outputs": []}])
    with pytest.raises(InvalidRequestError):
        store.create_run(tenant, PROGRAM, chain_calls(1), objectives={"x1": "fast"})
    assert store.list_runs(tenant) == []


def test_tenant_isolation(store: Store) -> None:
    a, _ = store.create_tenant("a")
    b, _ = store.create_tenant("b")
    run_a = store.create_run(a.id, PROGRAM, chain_calls(1), {"x0": "secret"}).run.id
    run_b = store.create_run(b.id, PROGRAM, chain_calls(1), {"x0": "mine"}).run.id
    assert [r.id for r in store.list_runs(a.id)] == [run_a]
    assert [r.id for r in store.list_runs(b.id)] == [run_b]
    for call in (
        lambda: store.get_run(b.id, run_a),
        lambda: store.get_variable(b.id, run_a, "x0"),
        lambda: store.read_events(b.id, run_a),
        lambda: store.set_variable(run_a, "x1", "forged", tenant_id=b.id),
        lambda: store.cancel_run(b.id, run_a),
        lambda: store.add_calls(b.id, run_a, chain_calls(1)),
        lambda: store.create_run(b.id, PROGRAM, chain_calls(1), replay_of=run_a),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert store.get_variable(a.id, run_a, "x0").value == "secret"
    assert store.get_variable(a.id, run_a, "x1").status == "pending"


def test_set_variable_is_idempotent_and_emits_once(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, PROGRAM, chain_calls(1)).run.id
    assert store.set_variable(run, "x0", "first", events=[("ready", {"n": "x0"})]) is True
    assert store.set_variable(run, "x0", "second", events=[("ready", {"n": "x0"})]) is False
    assert store.get_variable(tenant, run, "x0").value == "first"
    assert [e.type for e in store.read_events(tenant, run)] == ["ready"]
    with pytest.raises(NotFoundError):
        store.set_variable(run, "nope", "v")  # closed run: no new variables
    assert store.fail_variable(run, "x1", "boom") is True
    assert store.fail_variable(run, "x1", "boom") is False  # the same failure again
    assert store.fail_variable(run, "x1", "call 'c' failed: boom") is True  # why, named
    assert store.get_variable(tenant, run, "x1").error == "call 'c' failed: boom"
    assert store.set_variable(run, "x1", "late") is False
    assert store.get_variable(tenant, run, "x1").status == "failed"


def test_open_run_add_calls(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, PROGRAM, chain_calls(1), {"x0": "a"}, open=True).run.id
    assert store.add_calls(tenant, run, [{"inputs": ["x1"], "outputs": ["y"]}]) == [1]
    assert store.add_calls(tenant, run, [{"inputs": ["q"], "outputs": ["z"]}]) == [2]
    with pytest.raises(InvalidRequestError):
        store.add_calls(tenant, run, [{"inputs": [], "outputs": ["y"]}])  # y has a producer
    assert store.set_variable(run, "q", "late input", tenant_id=tenant) is True
    detail = store.get_run(tenant, run)
    assert [c.idx for c in detail.calls] == [0, 1, 2]
    assert detail.variables["y"].producer_call == 1 and detail.variables["q"].status == "ready"
    store.close_run(tenant, run)
    with pytest.raises(InvalidRequestError):
        store.add_calls(tenant, run, [{"inputs": [], "outputs": ["w"]}])


def test_run_status_and_recovery_view(store: Store, tenant: int) -> None:
    done = store.create_run(tenant, PROGRAM, chain_calls(1), {"x0": "a"}).run.id
    live = store.create_run(tenant, PROGRAM, chain_calls(2), {"x0": "a"}).run.id
    assert store.set_run_status(done, "running") is True
    assert store.set_run_status(done, "done", events=[("run_done", None)]) is True
    assert store.set_run_status(done, "running") is False  # finished runs never move again
    assert store.get_run(tenant, done).run.finished_at is not None
    (claimed,) = store.claim_calls("w", run_id=live)
    assert store.finish_call(claimed.call.id, "w", {"x1": "b"}).accepted
    assert store.annotate_calls(live, {1: {"objective": "latency", "task_group": "g"}}) == 1
    assert store.annotate_calls(live, {1: {"task_group": "h"}, 0: {}}) == 1  # keeps objective
    assert store.annotate_calls(live, {1: {"task_group": "g"}}) == 1
    with pytest.raises(InvalidRequestError):
        store.annotate_calls(live, {1: {"objective": "fast"}})
    assert store.get_run(tenant, live).calls[1].task_group == "g"
    (resume,) = store.unfinished_runs()
    assert resume.run.id == live
    assert resume.ready == {"x0": "a", "x1": "b"}
    assert [(c.idx, c.objective, c.task_group) for c in resume.calls] == [(1, "latency", "g")]
    replay = store.create_run(tenant, PROGRAM, chain_calls(1), {"x0": "a"}, replay_of=done)
    assert replay.run.replay_of == done
    assert store.cancel_run(tenant, live) is True
    assert {r.run.id for r in store.unfinished_runs()} == {replay.run.id}
    assert [r.id for r in store.list_runs(tenant, status="cancelled")] == [live]


def test_annotated_waits_are_kept_for_a_resumed_run(store: Store, tenant: int) -> None:
    run = store.create_run(tenant, PROGRAM, chain_calls(2), {"x0": "a"}, {"x1": "throughput"})
    assert (run.run.waits, run.run.stated) == ({}, False)  # none recorded yet
    waits = {"x2": "latency", "later": "throughput"}
    store.annotate_calls(run.run.id, {1: {"objective": "latency"}}, waits=waits, stated=True)
    store.annotate_calls(run.run.id, {1: {"objective": "latency"}})  # no waits: kept
    (resume,) = store.unfinished_runs()
    assert (resume.run.waits, resume.run.stated) == (waits, True)
    assert resume.run.objectives == {"x1": "throughput"}  # the declared outputs apart
    assert store.get_run(tenant, run.run.id).run.waits == waits
    with pytest.raises(InvalidRequestError):
        store.annotate_calls(run.run.id, {}, waits={"x2": "fast"})


def test_program_json_round_trips_with_key_order(store: Store, tenant: int) -> None:
    # A call's outputs are generated in listed order, so key order must survive storage.
    program = {
        "public": True,
        "calls": [
            {"template": "t", "outputs": {"zeta": {"max_tokens": 5}, "alpha": {}, "mid": {}}}
        ],
    }
    inputs = {"b": "2", "a": "1", "c": "ünïcode {{input:x}}"}
    run = store.create_run(tenant, program, [{"inputs": ["a"], "outputs": ["zeta"]}], inputs)
    detail = store.get_run(tenant, run.run.id)
    assert json.dumps(detail.program) == json.dumps(program)
    assert list(detail.inputs) == ["b", "a", "c"] and detail.inputs["c"] == inputs["c"]
    wf = store.register_workflow(tenant, "ordered", program)
    assert json.dumps(store.get_workflow(tenant, "ordered", wf.version).program) == json.dumps(
        program
    )
