"""Semantic variable values: set once (pending -> ready), never overwritten."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update
from sqlalchemy.orm import Session

from parrot_backend.store.base import StoreBase, variable_record
from parrot_backend.store.columns import utcnow
from parrot_backend.store.errors import NotFoundError
from parrot_backend.store.events import append_in
from parrot_backend.store.models import Run, Variable
from parrot_backend.store.records import VariableRecord

_VARS = Variable.__table__
_RUNS = Run.__table__
# Prebuilt: the conditional UPDATE (``status = 'pending'``) is what makes a value write-once.
_SET_VALUE = (
    update(_VARS)
    .where(
        _VARS.c.run_id == bindparam("rid"),
        _VARS.c.name == bindparam("vname"),
        _VARS.c.status == "pending",
    )
    .values(value=bindparam("value"), status="ready", set_at=bindparam("now"))
)
_RUN_OWNER = select(_RUNS.c.tenant_id, _RUNS.c.open).where(_RUNS.c.id == bindparam("rid"))


def set_values_in(
    db: Session | Connection, run_id: str, values: Mapping[str, str], now: datetime
) -> list[str]:
    """Make pending variables ready inside a write transaction; return the names changed.

    A second writer, a retried call or a replayed request changes nothing: only a pending
    variable takes a value.
    """
    conn = db.connection() if isinstance(db, Session) else db
    return [
        name
        for name, value in values.items()
        if conn.execute(
            _SET_VALUE, {"rid": run_id, "vname": name, "value": value, "now": now}
        ).rowcount
    ]


def _run(session: Session, run_id: str, tenant_id: int | None) -> Run:
    run = session.get(Run, run_id)
    if run is None or (tenant_id is not None and run.tenant_id != tenant_id):
        raise NotFoundError(f"no run {run_id!r}")
    return run


class VariablesMixin(StoreBase):
    """Set, fail and read semantic variables."""

    def set_variable(
        self,
        run_id: str,
        name: str,
        value: str,
        *,
        tenant_id: int | None = None,
        events: Sequence[tuple[str, Any]] = (),
    ) -> bool:
        """Set a variable's value; True when it changed (it was pending).

        A ready variable is never overwritten. ``events`` (type, payload) are appended in the
        same transaction only when the value changed, so each is observed once. Pass
        ``tenant_id`` for client requests; an unknown variable is created on an open run.
        """
        return bool(self.set_variables(run_id, {name: value}, tenant_id=tenant_id, events=events))

    def set_variables(
        self,
        run_id: str,
        values: Mapping[str, str],
        *,
        tenant_id: int | None = None,
        events: Sequence[tuple[str, Any]] = (),
    ) -> list[str]:
        """Set several variables in one transaction; returns the names that changed."""
        now = utcnow()
        with self._conn_write() as c:
            owner = None
            if tenant_id is not None:  # a client's request: the run must be the tenant's
                owner = c.execute(_RUN_OWNER, {"rid": run_id}).first()
                if owner is None or owner.tenant_id != tenant_id:
                    raise NotFoundError(f"no run {run_id!r}")
            changed = set(set_values_in(c, run_id, values, now))
            if len(changed) < len(values):  # already set, unknown, or no such run
                owner = owner or c.execute(_RUN_OWNER, {"rid": run_id}).first()
                if owner is None:
                    raise NotFoundError(f"no run {run_id!r}")
                rest = [n for n in values if n not in changed]
                known = set(
                    c.scalars(
                        select(_VARS.c.name).where(_VARS.c.run_id == run_id, _VARS.c.name.in_(rest))
                    )
                )
                missing = [n for n in rest if n not in known]
                if missing and not owner.open:
                    raise NotFoundError(f"run {run_id!r} has no variable(s) {missing}")
                if missing:  # an open run takes new variables
                    c.execute(
                        insert(_VARS),
                        [
                            {
                                "run_id": run_id,
                                "name": n,
                                "value": values[n],
                                "status": "ready",
                                "set_at": now,
                            }
                            for n in missing
                        ],
                    )
                    changed.update(missing)
            names = [n for n in values if n in changed]
            if names and events:
                append_in(c, [(run_id, t, p) for t, p in events], now)
            return names

    def fail_variable(self, run_id: str, name: str, error: str) -> bool:
        """Mark a variable failed with `error` (its producer gave up); True when it changed:
        it was pending, or failed with another error (`fail_call` fails a call's outputs
        with the call's error; the manager's `variable_failed` that follows names why,
        and is recorded once: the same event again, after a restart, changes nothing)."""
        with self._write() as s:
            result = s.execute(
                update(Variable)
                .where(
                    Variable.run_id == run_id,
                    Variable.name == name,
                    (Variable.status == "pending")
                    | ((Variable.status == "failed") & (Variable.error.is_distinct_from(error))),
                )
                .values(status="failed", error=error, set_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            return bool(result.rowcount)

    def get_variables(self, tenant_id: int, run_id: str) -> dict[str, VariableRecord]:
        """Every variable of a tenant's run, by name, in one read."""
        with self._read() as s:
            _run(s, run_id, tenant_id)
            found = s.scalars(select(Variable).where(Variable.run_id == run_id))
            return {v.name: variable_record(v) for v in found}

    def get_variable(self, tenant_id: int, run_id: str, name: str) -> VariableRecord:
        """One variable of a tenant's run."""
        with self._read() as s:
            _run(s, run_id, tenant_id)
            var = s.scalar(select(Variable).where(Variable.run_id == run_id, Variable.name == name))
            if var is None:
                raise NotFoundError(f"run {run_id!r} has no variable {name!r}")
            return variable_record(var)
