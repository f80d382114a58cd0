"""Runs: creation from call descriptors, incremental calls, status, listing, detail
(recovery and ownership: `recovery.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    String,
    Text,
    bindparam,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Session

from parrot_backend.store.base import (
    StoreBase,
    call_record,
    run_record,
    variable_record,
)
from parrot_backend.store.columns import (
    CALL_HELD,
    OBJECTIVES,
    RUN_FINISHED,
    RUN_STATUSES,
    RUN_UNFINISHED,
    UTCDateTime,
    utcnow,
)
from parrot_backend.store.errors import InvalidRequestError, NotFoundError
from parrot_backend.store.events import append_in
from parrot_backend.store.models import VALUE_TYPES, Call, CallInput, Run, Variable
from parrot_backend.store.plan import CallDescriptor, check_producers, parse_calls
from parrot_backend.store.records import RunDetail, RunRecord

_RUNS = Run.__table__
_VARS = Variable.__table__
_CALLS = Call.__table__
_EDGES = CallInput.__table__
_NEW_VARS = insert(_VARS).returning(_VARS.c.name, _VARS.c.id, sort_by_parameter_order=True)
_NEW_CALLS = insert(_CALLS).returning(_CALLS.c.id, sort_by_parameter_order=True)
_SET_PRODUCER = (
    update(_VARS)
    .where(_VARS.c.run_id == bindparam("rid"), _VARS.c.name == bindparam("vname"))
    .values(producer_call=bindparam("producer"), type=bindparam("vtype"))
)


def output_types(calls: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The types descriptors give their outputs (``"types": {output: type}``; an output not
    named there is text); InvalidRequestError for an unknown type."""
    types: dict[str, str] = {}
    for i, desc in enumerate(calls):
        given = desc.get("types") if isinstance(desc, Mapping) else None
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise InvalidRequestError(f"call {i}: types must map outputs to types")
        outputs = set(desc.get("outputs") or ())
        for name, kind in given.items():
            if kind not in VALUE_TYPES:
                raise InvalidRequestError(
                    f"call {i}: type of {name!r} must be one of {VALUE_TYPES}, got {kind!r}"
                )
            if name not in outputs:
                raise InvalidRequestError(f"call {i}: types names {name!r}, not an output")
            types[name] = kind
    return types


def _insert_calls(
    c: Connection,
    run_id: str,
    plans: Sequence[CallDescriptor],
    first_idx: int,
    now: datetime,
    variables: dict[str, int] | None = None,
    types: Mapping[str, str] | None = None,
) -> None:
    """Insert calls, their variables (pending when new) and the DAG's input edges.
    ``variables``: the run's variables (name -> id), when the caller knows them; ``types``:
    the type of each typed output (others are text)."""
    types = types or {}
    if variables is None:
        variables = dict(
            c.execute(select(_VARS.c.name, _VARS.c.id).where(_VARS.c.run_id == run_id)).all()
        )
    producer: dict[str, int] = {}
    new: dict[str, None] = {}  # in first-use order
    for offset, plan in enumerate(plans):
        for name in (*plan.inputs, *plan.outputs):
            if name not in variables:
                new[name] = None
        for out in plan.outputs:
            producer[out] = first_idx + offset
    if new:
        variables.update(
            c.execute(
                _NEW_VARS,
                [
                    {
                        "run_id": run_id,
                        "name": n,
                        "status": "pending",
                        "producer_call": producer.get(n),
                        "type": types.get(n, "text"),
                    }
                    for n in new
                ],
            ).all()
        )
    known = [
        {"rid": run_id, "vname": n, "producer": i, "vtype": types.get(n, "text")}
        for n, i in producer.items()
        if n not in new
    ]
    if known:
        c.execute(_SET_PRODUCER, known)
    ids = (
        c.execute(
            _NEW_CALLS,
            [
                {
                    "run_id": run_id,
                    "idx": first_idx + offset,
                    "name": plan.name,
                    "inputs": list(plan.inputs),
                    "outputs": list(plan.outputs),
                    "status": "pending",
                    "objective": plan.objective,
                    "task_group": plan.task_group,
                    "attempts": 0,
                    "queued_at": now,
                }
                for offset, plan in enumerate(plans)
            ],
        )
        .scalars()
        .all()
    )
    edges = [
        {"call_id": call_id, "variable_id": variables[name]}
        for call_id, plan in zip(ids, plans, strict=True)
        for name in plan.inputs
    ]
    if edges:
        c.execute(insert(_EDGES), edges)


def _owned_run(db: Session | Connection, tenant_id: int, run_id: str) -> Row[Any]:
    """The run's row (every column), if it is the tenant's."""
    conn = db.connection() if isinstance(db, Session) else db
    run = conn.execute(select(_RUNS).where(_RUNS.c.id == run_id)).first()
    if run is None or run.tenant_id != tenant_id:
        raise NotFoundError(f"no run {run_id!r}")
    return run


def _detail(db: Session | Connection, run: Row[Any]) -> RunDetail:
    conn = db.connection() if isinstance(db, Session) else db
    variables = conn.execute(select(_VARS).where(_VARS.c.run_id == run.id).order_by(_VARS.c.id))
    calls = conn.execute(select(_CALLS).where(_CALLS.c.run_id == run.id).order_by(_CALLS.c.idx))
    records = {v.name: variable_record(v) for v in variables}
    # the inputs given when the run was created, then those an open run was given later
    inputs = dict(run.inputs)
    for name, v in records.items():
        if v.producer_call is None and v.value is not None and name not in inputs:
            inputs[name] = v.value
    return RunDetail(
        run=run_record(run),
        program=run.program,
        inputs=inputs,
        variables=records,
        calls=tuple(call_record(c) for c in calls),
    )


# Prebuilt (a hot path: every run starts and finishes through it).
_SET_STATUS = (
    update(_RUNS)
    .where(
        _RUNS.c.id == bindparam("rid"),
        _RUNS.c.status.in_(RUN_UNFINISHED),
        _RUNS.c.status != bindparam("status"),
    )
    .values(
        status=bindparam("status"),
        finished_at=func.coalesce(
            bindparam("finished_at", type_=UTCDateTime()), _RUNS.c.finished_at
        ),
        error=func.coalesce(bindparam("error", type_=Text()), _RUNS.c.error),
    )
)


# a cancelled run's calls that had not ended: recorded as cancelled, their claims released
_CANCEL_CALLS = (
    update(_CALLS)
    .where(_CALLS.c.run_id == bindparam("rid"), _CALLS.c.status.in_(("pending", *CALL_HELD)))
    .values(
        status="cancelled",
        finished_at=bindparam("finished_at", type_=UTCDateTime()),
        claimed_by=None,
        lease_expires_at=None,
    )
)
_ANNOTATE = (
    update(_CALLS)
    .where(_CALLS.c.run_id == bindparam("rid"), _CALLS.c.idx == bindparam("b_idx"))
    .values(
        objective=case(
            (bindparam("has_objective"), bindparam("b_objective", type_=String())),
            else_=_CALLS.c.objective,
        ),
        task_group=case(
            (bindparam("has_group"), bindparam("b_task_group", type_=String())),
            else_=_CALLS.c.task_group,
        ),
    )
)


class RunsMixin(StoreBase):
    """Create runs, add calls, change status, list and inspect runs."""

    def create_run(
        self,
        tenant_id: int,
        program: Mapping[str, Any],
        calls: Sequence[Mapping[str, Any]],
        inputs: Mapping[str, str] | None = None,
        objectives: Mapping[str, str] | None = None,
        *,
        open: bool = False,
        workflow_id: int | None = None,
        replay_of: str | None = None,
        events: Sequence[tuple[str, Any]] = (),
        run_id: str | None = None,
        owner: str | None = None,
        owner_lease_s: float = 30.0,
    ) -> RunDetail:
        """Persist a run with its variables and calls (all pending; inputs ready).
        ``owner`` (a manager process) holds the run from the start (see `claim_run`).

        ``calls`` are descriptors ``{"name", "inputs", "outputs", "objective"?,
        "task_group"?, "types"?}`` in program order (their position is the call index);
        ``types`` maps typed outputs to their type (`VALUE_TYPES`), the rest are text.
        ``objectives`` maps output variable names to ``latency`` or ``throughput``.
        ``run_id`` lets the caller (the server's manager) choose the id.
        """
        plans = parse_calls(calls)
        types = output_types(calls)
        inputs = dict(inputs or {})
        objectives = dict(objectives or {})
        bad = {k: v for k, v in objectives.items() if v not in OBJECTIVES}
        if bad:
            raise InvalidRequestError(f"objectives must be one of {OBJECTIVES}: {bad}")
        check_producers(plans, {}, inputs, 0)
        now = utcnow()
        run_id = run_id or uuid.uuid4().hex
        with self._conn_write() as c:
            if replay_of is not None:
                _owned_run(c, tenant_id, replay_of)
            c.execute(
                insert(_RUNS).values(
                    id=run_id,
                    tenant_id=tenant_id,
                    workflow_id=workflow_id,
                    program=dict(program),
                    inputs=inputs,
                    objectives=objectives,
                    status="pending",
                    open=open,
                    created_at=now,
                    replay_of=replay_of,
                    event_seq=0,
                    owner=owner,
                    owner_lease_expires_at=(
                        now + timedelta(seconds=owner_lease_s) if owner else None
                    ),
                )
            )
            variables: dict[str, int] = {}
            if inputs:
                variables.update(
                    c.execute(
                        _NEW_VARS,
                        [
                            {
                                "run_id": run_id,
                                "name": name,
                                "value": value,
                                "status": "ready",
                                "set_at": now,
                            }
                            for name, value in inputs.items()
                        ],
                    ).all()
                )
            _insert_calls(c, run_id, plans, 0, now, variables, types)
            if events:
                append_in(c, [(run_id, t, p) for t, p in events], now)
            return _detail(c, c.execute(select(_RUNS).where(_RUNS.c.id == run_id)).one())

    def add_calls(
        self,
        tenant_id: int,
        run_id: str,
        calls: Sequence[Mapping[str, Any]],
        *,
        program: Mapping[str, Any] | None = None,
        events: Sequence[tuple[str, Any]] = (),
    ) -> list[int]:
        """Append calls to an open run; returns their indices. ``program`` replaces the
        stored program JSON (the caller's merged program), when given; ``events`` are
        appended in the same transaction."""
        plans = parse_calls(calls)
        types = output_types(calls)
        with self._conn_write() as c:
            run = _owned_run(c, tenant_id, run_id)
            if not run.open:
                raise InvalidRequestError(f"run {run_id!r} is closed")
            if run.status in RUN_FINISHED:
                raise InvalidRequestError(f"run {run_id!r} is {run.status}")
            rows = c.execute(
                select(_VARS.c.name, _VARS.c.id, _VARS.c.producer_call, _VARS.c.status).where(
                    _VARS.c.run_id == run_id
                )
            ).all()
            produced = {n: p for n, _, p, _ in rows if p is not None}
            given = [n for n, _, p, st in rows if p is None and st == "ready"]
            last = c.scalar(select(func.max(_CALLS.c.idx)).where(_CALLS.c.run_id == run_id))
            first = 0 if last is None else last + 1
            check_producers(plans, produced, given, first)
            _insert_calls(c, run_id, plans, first, utcnow(), {n: i for n, i, _, _ in rows}, types)
            if program is not None:
                c.execute(update(_RUNS).where(_RUNS.c.id == run_id).values(program=dict(program)))
            if events:
                append_in(c, [(run_id, t, p) for t, p in events])
            return list(range(first, first + len(plans)))

    def annotate_calls(
        self,
        run_id: str,
        plans: Mapping[int, Mapping[str, Any]],
        *,
        waits: Mapping[str, str] | None = None,
        stated: bool = False,
        events: Sequence[tuple[str, Any]] = (),
    ) -> int:
        """Record the manager's deductions per call index: ``objective`` and ``task_group``
        (with ``events`` appended in the same transaction). ``waits``, when given, replace
        the run's: what clients wait for beyond its objectives (variable -> criterion),
        with whether a client ``stated`` any criterion; a resumed run deduces from them."""
        if waits is not None:
            bad = {k: v for k, v in waits.items() if v not in OBJECTIVES}
            if bad:
                raise InvalidRequestError(f"waits must be one of {OBJECTIVES}: {bad}")
        rows = []
        for idx, plan in plans.items():
            if plan.get("objective") not in (None, *OBJECTIVES):
                raise InvalidRequestError(f"call {idx}: bad objective {plan['objective']!r}")
            if "objective" not in plan and "task_group" not in plan:
                continue
            # a key left out keeps its value
            rows.append(
                {
                    "rid": run_id,
                    "b_idx": idx,
                    "has_objective": "objective" in plan,
                    "b_objective": plan.get("objective"),
                    "has_group": "task_group" in plan,
                    "b_task_group": plan.get("task_group"),
                }
            )
        with self._conn_write() as c:
            if events:
                append_in(c, [(run_id, t, p) for t, p in events])
            if waits is not None:
                c.execute(
                    update(_RUNS)
                    .where(_RUNS.c.id == run_id)
                    .values(waits=dict(waits), stated=stated)
                )
            return sum(c.execute(_ANNOTATE, row).rowcount for row in rows)

    def set_run_status(
        self,
        run_id: str,
        status: str,
        *,
        error: str | None = None,
        events: Sequence[tuple[str, Any]] = (),
    ) -> bool:
        """Move a run to ``status``; a finished run never changes again. True when changed.
        ``events`` are appended in the same transaction only when it changed."""
        if status not in RUN_STATUSES:
            raise InvalidRequestError(f"bad run status {status!r}")
        now = utcnow()
        params = {
            "rid": run_id,
            "status": status,
            "error": error,
            "finished_at": now if status in RUN_FINISHED else None,
        }
        with self._conn_write() as c:
            changed = c.execute(_SET_STATUS, params).rowcount
            if changed and status == "cancelled":
                c.execute(_CANCEL_CALLS, {"rid": run_id, "finished_at": now})
            if changed and events:
                append_in(c, [(run_id, t, p) for t, p in events], now)
            return bool(changed)

    def cancel_run(self, tenant_id: int, run_id: str) -> bool:
        """Cancel a tenant's unfinished run; its calls are no longer claimable."""
        with self._read() as s:
            _owned_run(s, tenant_id, run_id)
        return self.set_run_status(run_id, "cancelled", events=[("run_cancelled", None)])

    def close_run(self, tenant_id: int, run_id: str) -> None:
        """Mark an open run closed: no more calls will be added."""
        with self._conn_write() as c:
            _owned_run(c, tenant_id, run_id)
            c.execute(update(_RUNS).where(_RUNS.c.id == run_id).values(open=False))

    def get_run(self, tenant_id: int, run_id: str) -> RunDetail:
        """A tenant's run with variables, calls (the DAG), objectives, task groups, timings."""
        with self._read() as s:
            return _detail(s, _owned_run(s, tenant_id, run_id))

    def list_runs(
        self,
        tenant_id: int,
        *,
        status: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[RunRecord]:
        """A tenant's runs, newest first."""
        query = select(Run).where(Run.tenant_id == tenant_id)
        if status is not None:
            query = query.where(Run.status == status)
        query = query.order_by(Run.created_at.desc(), Run.id).limit(limit).offset(offset)
        with self._read() as s:
            return [run_record(r) for r in s.scalars(query)]
