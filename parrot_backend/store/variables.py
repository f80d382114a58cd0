"""Semantic variable values: set once (pending -> ready), never overwritten."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from parrot_backend.store.base import StoreBase, variable_record
from parrot_backend.store.columns import utcnow
from parrot_backend.store.errors import NotFoundError
from parrot_backend.store.events import append_in
from parrot_backend.store.models import Run, Variable
from parrot_backend.store.records import VariableRecord


def set_values_in(
    session: Session, run_id: str, values: Mapping[str, str], now: datetime
) -> list[str]:
    """Make pending variables ready inside a write transaction; return the names changed.

    The conditional UPDATE (``status = 'pending'``) is what makes a value write-once:
    a second writer, a retried call or a replayed request changes nothing.
    """
    changed = []
    for name, value in values.items():
        result = session.execute(
            update(Variable)
            .where(Variable.run_id == run_id, Variable.name == name, Variable.status == "pending")
            .values(value=value, status="ready", set_at=now)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount:
            changed.append(name)
    return changed


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
        with self._write() as s:
            run = _run(s, run_id, tenant_id)
            known = set(
                s.scalars(
                    select(Variable.name).where(
                        Variable.run_id == run_id, Variable.name.in_(list(values))
                    )
                )
            )
            missing = [n for n in values if n not in known]
            if missing and not run.open:
                raise NotFoundError(f"run {run_id!r} has no variable(s) {missing}")
            for n in missing:
                s.add(Variable(run_id=run_id, name=n, status="pending"))
            s.flush()
            changed = set_values_in(s, run_id, values, now)
            if changed and events:
                append_in(s, [(run_id, t, p) for t, p in events], now)
            return changed

    def fail_variable(self, run_id: str, name: str, error: str) -> bool:
        """Mark a pending variable failed (its producer gave up); True when it changed."""
        with self._write() as s:
            result = s.execute(
                update(Variable)
                .where(
                    Variable.run_id == run_id, Variable.name == name, Variable.status == "pending"
                )
                .values(status="failed", error=error, set_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            return bool(result.rowcount)

    def get_variable(self, tenant_id: int, run_id: str, name: str) -> VariableRecord:
        """One variable of a tenant's run."""
        with self._read() as s:
            _run(s, run_id, tenant_id)
            var = s.scalar(
                select(Variable).where(Variable.run_id == run_id, Variable.name == name)
            )
            if var is None:
                raise NotFoundError(f"run {run_id!r} has no variable {name!r}")
            return variable_record(var)
