"""Run ownership and recovery: the runs a manager resumes after a restart, and the lease
by which one manager among several sharing the database owns each run."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from parrot_backend.store.base import StoreBase, call_record, run_record
from parrot_backend.store.columns import CALL_HELD, RUN_UNFINISHED, utcnow
from parrot_backend.store.models import Call, Run, Variable
from parrot_backend.store.records import UnfinishedRun


class RecoveryMixin(StoreBase):
    """Find unfinished runs; claim, renew and adopt runs by lease."""

    def unfinished_runs(self) -> list[UnfinishedRun]:
        """Runs to resume after a restart (pending/running), all tenants: ready values and
        the calls not done (a call claimed by a dead process comes back when its lease
        expires, or at once after :meth:`release_worker_claims`)."""
        with self._read() as s:
            runs = s.scalars(
                select(Run).where(Run.status.in_(RUN_UNFINISHED)).order_by(Run.created_at)
            ).all()
            result = []
            for run in runs:
                ready = dict(
                    s.execute(
                        select(Variable.name, Variable.value).where(
                            Variable.run_id == run.id, Variable.status == "ready"
                        )
                    ).all()
                )
                calls = s.scalars(
                    select(Call)
                    .where(Call.run_id == run.id, Call.status != "done")
                    .order_by(Call.idx)
                )
                result.append(
                    UnfinishedRun(
                        run=run_record(run),
                        program=run.program,
                        ready=ready,
                        calls=tuple(call_record(c) for c in calls),
                    )
                )
            return result

    def claim_run(self, run_id: str, worker: str, *, lease_s: float) -> bool:
        """Make ``worker`` the run's owner if nobody else holds it (no owner, the same
        worker, or an expired lease). One conditional UPDATE: atomic on SQLite and
        PostgreSQL, so of several managers sharing the database exactly one wins."""
        now = utcnow()
        with self._write() as s:
            won = s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_(RUN_UNFINISHED))
                .where(
                    (Run.owner.is_(None))
                    | (Run.owner == worker)
                    | (Run.owner_lease_expires_at < now)
                )
                .values(owner=worker, owner_lease_expires_at=now + timedelta(seconds=lease_s))
            ).rowcount
            if won:
                # the previous owner stopped renewing: the calls it held are stale claims
                s.execute(
                    update(Call)
                    .where(
                        Call.run_id == run_id, Call.status.in_(CALL_HELD), Call.claimed_by != worker
                    )
                    .values(status="pending", claimed_by=None, lease_expires_at=None)
                )
        return bool(won)

    def renew_runs(self, worker: str, *, lease_s: float) -> int:
        """Extend the lease on every unfinished run ``worker`` owns; returns how many."""
        with self._write() as s:
            return s.execute(
                update(Run)
                .where(Run.owner == worker, Run.status.in_(RUN_UNFINISHED))
                .values(owner_lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            ).rowcount

    def adoptable_runs(self, worker: str) -> list[str]:
        """Unfinished runs with no live owner other than ``worker`` (oldest first)."""
        now = utcnow()
        with self._read() as s:
            return list(
                s.scalars(
                    select(Run.id)
                    .where(Run.status.in_(RUN_UNFINISHED))
                    .where(
                        (Run.owner.is_(None))
                        | (Run.owner == worker)
                        | (Run.owner_lease_expires_at < now)
                    )
                    .order_by(Run.created_at)
                )
            )
