"""The per-run event log: batched appends with monotonic seqs, reads after a seq, retention."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, case, delete, insert, select, update
from sqlalchemy.orm import Session

from parrot_backend.store.base import StoreBase
from parrot_backend.store.columns import RUN_FINISHED, utcnow
from parrot_backend.store.errors import NotFoundError
from parrot_backend.store.models import Event, Run
from parrot_backend.store.records import EventRecord

# (run_id, type, payload)
EventIn = tuple[str, str, Any]


_RUNS = Run.__table__
# Prebuilt statements (built once; only their parameters change per call).
_BUMP_SEQ = (
    update(_RUNS)
    .where(_RUNS.c.id == bindparam("rid"))
    .values(event_seq=_RUNS.c.event_seq + bindparam("n"))
    .returning(_RUNS.c.event_seq)
)
_INSERT_EVENTS = insert(Event.__table__)


def append_in(
    db: Session | Connection, items: Sequence[EventIn], now: datetime | None = None
) -> list[int]:
    """Append events inside an open write transaction; return their seqs in input order.

    Each run's counter is bumped once per batch with UPDATE ... RETURNING: the row lock it
    takes makes concurrent appenders to one run wait for each other until commit, so seqs
    are gap-free, strictly increasing, and become visible in order. On PostgreSQL the runs
    of a batch are locked in sorted order, so two batches touching the same runs cannot
    deadlock.
    """
    if not items:
        return []
    conn = db.connection() if isinstance(db, Session) else db
    now = now or utcnow()
    counts = Counter(run_id for run_id, _, _ in items)
    if len(counts) == 1:  # the common case: one prebuilt statement
        ((run_id, n),) = counts.items()
        ends = {run_id: conn.execute(_BUMP_SEQ, {"rid": run_id, "n": n}).scalar()}
    else:  # one UPDATE bumps every run of the batch
        ids = sorted(counts)
        if conn.dialect.name == "postgresql":
            # lock in id order first: a lone UPDATE locks rows in scan order, which can
            # deadlock against another batch
            conn.execute(
                select(_RUNS.c.id).where(_RUNS.c.id.in_(ids)).order_by(_RUNS.c.id).with_for_update()
            )
        ends = dict(
            conn.execute(
                update(_RUNS)
                .where(_RUNS.c.id.in_(ids))
                .values(event_seq=_RUNS.c.event_seq + case(dict(counts), value=_RUNS.c.id))
                .returning(_RUNS.c.id, _RUNS.c.event_seq)
            ).all()
        )
    missing = sorted(r for r in counts if ends.get(r) is None)
    if missing:
        raise NotFoundError(f"no run(s) {missing}")
    next_seq = {run_id: ends[run_id] - counts[run_id] for run_id in counts}
    seqs: list[int] = []
    rows: list[dict[str, Any]] = []
    for run_id, type_, payload in items:
        next_seq[run_id] += 1
        seqs.append(next_seq[run_id])
        rows.append(
            {
                "run_id": run_id,
                "seq": next_seq[run_id],
                "type": type_,
                "payload": payload,
                "created_at": now,
            }
        )
    # Core insert of the table (not the ORM bulk path): a plain executemany, fastest here.
    conn.execute(_INSERT_EVENTS, rows)
    return seqs


def _record(e: Event) -> EventRecord:
    return EventRecord(
        run_id=e.run_id, seq=e.seq, type=e.type, payload=e.payload, created_at=e.created_at
    )


class EventsMixin(StoreBase):
    """Append and read run events; prune old ones."""

    def append_event(self, run_id: str, type: str, payload: Any = None) -> int:
        """Append one event; returns its seq once committed."""
        with self._conn_write() as c:
            return append_in(c, [(run_id, type, payload)])[0]

    def append_events(self, items: Sequence[EventIn]) -> list[int]:
        """Append a batch of (run_id, type, payload) in one transaction; seqs in input order."""
        with self._conn_write() as c:
            return append_in(c, items)

    def read_events(
        self, tenant_id: int, run_id: str, after_seq: int = 0, limit: int = 1000
    ) -> list[EventRecord]:
        """Events of a tenant's run with seq > ``after_seq`` (SSE ``Last-Event-ID``), in order."""
        with self._read() as s:
            rows = s.scalars(
                select(Event)
                .join(Run, Run.id == Event.run_id)
                .where(Run.tenant_id == tenant_id, Event.run_id == run_id, Event.seq > after_seq)
                .order_by(Event.seq)
                .limit(limit)
            ).all()
            if (
                not rows
                and s.scalar(select(Run.id).where(Run.id == run_id, Run.tenant_id == tenant_id))
                is None
            ):
                raise NotFoundError(f"no run {run_id!r}")
            return [_record(e) for e in rows]

    def last_event_seq(self, run_id: str) -> int:
        """The seq of a run's last event (0 when none)."""
        with self._read() as s:
            seq = s.scalar(select(Run.event_seq).where(Run.id == run_id))
            if seq is None:
                raise NotFoundError(f"no run {run_id!r}")
            return seq

    def prune_events(
        self,
        *,
        older_than_days: float | None = None,
        keep_last: int | None = None,
        now: datetime | None = None,
    ) -> int:
        """Retention for finished runs only: drop events older than N days and/or all but the
        last N of each run. Unfinished runs keep everything (recovery and streams need it).
        Returns the number of events deleted."""
        finished = select(Run.id).where(Run.status.in_(RUN_FINISHED))
        deleted = 0
        with self._write() as s:
            if older_than_days is not None:
                cutoff = (now or utcnow()) - timedelta(days=older_than_days)
                deleted += s.execute(
                    delete(Event)
                    .where(Event.run_id.in_(finished), Event.created_at < cutoff)
                    .execution_options(synchronize_session=False)
                ).rowcount
            if keep_last is not None:
                # Seqs are gap-free up to runs.event_seq, so "the last N" is a seq threshold.
                last = select(Run.event_seq).where(Run.id == Event.run_id).scalar_subquery()
                deleted += s.execute(
                    delete(Event)
                    .where(Event.run_id.in_(finished), Event.seq <= last - keep_last)
                    .execution_options(synchronize_session=False)
                ).rowcount
        return deleted
