"""Call execution: row-level claims with leases, lifecycle timings, recorded outputs.

A worker (one manager process) claims ready calls. On PostgreSQL the candidates are
locked with ``SELECT ... FOR UPDATE SKIP LOCKED`` so concurrent claimers pass each other
by; on SQLite the claim runs in a ``BEGIN IMMEDIATE`` transaction (one writer at a time)
and the UPDATE repeats the claimable condition. Either way a call is held by one worker
at a time. A claim carries a lease; a worker that dies stops renewing it and the call
becomes claimable again when it expires (at-least-once execution). Every later step is
fenced on ``claimed_by``: a worker that lost its claim can no longer record anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, case, exists, func, or_, select, update
from sqlalchemy.orm import Session

from parrot_backend.store.base import StoreBase, call_record
from parrot_backend.store.columns import CALL_HELD, RUN_UNFINISHED, UTCDateTime, utcnow
from parrot_backend.store.errors import InvalidRequestError, NotFoundError
from parrot_backend.store.events import append_in
from parrot_backend.store.models import Call, CallInput, Run, Variable
from parrot_backend.store.records import ClaimedCall, FinishResult
from parrot_backend.store.variables import set_values_in


def _claimable(now: datetime) -> Any:
    return or_(
        Call.status == "pending",
        and_(Call.status.in_(CALL_HELD), Call.lease_expires_at < now),
    )


def _ready() -> Any:
    """All input variables of the call are ready (SQL over the DAG edges)."""
    waiting = (
        select(CallInput.call_id)
        .join(Variable, Variable.id == CallInput.variable_id)
        .where(CallInput.call_id == Call.id, Variable.status != "ready")
    )
    return ~exists(waiting)


def _live_run() -> Any:
    return exists(select(Run.id).where(Run.id == Call.run_id, Run.status.in_(RUN_UNFINISHED)))


def _fenced(s: Session, call_id: int, worker: str, statuses: Sequence[str], **values: Any) -> bool:
    result = s.execute(
        update(Call)
        .where(Call.id == call_id, Call.claimed_by == worker, Call.status.in_(statuses))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)


_CALLS = Call.__table__
_C = _CALLS.c


def _hold_stmt(start: bool) -> Any:
    now = bindparam("now")
    held = _C.status.in_(CALL_HELD)
    values: dict[str, Any] = {
        "claimed_by": bindparam("worker"),
        "lease_expires_at": bindparam("lease"),
    }
    if start:
        values.update(
            status="running",
            engine=bindparam("engine"),
            started_at=now,
            first_token_at=None,
            attempts=_C.attempts + 1,
        )
    else:
        values.update(status="claimed")
    return (
        update(_CALLS)
        .where(
            _C.id == bindparam("cid"),
            or_(
                _C.status == "pending",
                and_(held, _C.lease_expires_at < now),
                and_(held, _C.claimed_by == bindparam("worker")),
            ),
        )
        .values(**values)
        .returning(_C.run_id)
    )


# Prebuilt hot-path statements (built once; only their parameters change per call).
_HOLD = {True: _hold_stmt(True), False: _hold_stmt(False)}
_FINISH = (
    update(_CALLS)
    .where(
        _C.id == bindparam("cid"), _C.claimed_by == bindparam("worker"), _C.status.in_(CALL_HELD)
    )
    .values(
        status="done",
        finished_at=bindparam("now"),
        lease_expires_at=None,
        prompt_tokens=bindparam("prompt_tokens"),
        completion_tokens=bindparam("completion_tokens"),
        error=None,
        first_token_at=func.coalesce(
            bindparam("first_token_at", type_=UTCDateTime()), _C.first_token_at
        ),
    )
    .returning(_C.run_id, _C.outputs)
)
_CALL_EXISTS = select(_C.id).where(_C.id == bindparam("cid"))


class CallsMixin(StoreBase):
    """Claim calls, record their progress and results, release stale claims."""

    def claim_calls(
        self,
        worker: str,
        *,
        limit: int = 1,
        lease_s: float = 30.0,
        run_id: str | None = None,
        now: datetime | None = None,
    ) -> list[ClaimedCall]:
        """Claim up to ``limit`` ready calls for ``worker`` (latency objective first, then
        oldest). A call is ready when all its inputs are ready and its run is unfinished;
        pending calls and calls whose lease expired are claimable."""
        now = now or utcnow()
        candidates = (
            select(Call.id)
            .where(_claimable(now), _ready(), _live_run())
            .order_by(case((Call.objective == "latency", 0), else_=1), Call.id)
            .limit(limit)
        )
        if run_id is not None:
            candidates = candidates.where(Call.run_id == run_id)
        with self._write() as s:
            if self.dialect == "postgresql":
                candidates = candidates.with_for_update(skip_locked=True, of=Call)
            ids = list(s.scalars(candidates))
            if not ids:
                return []
            s.execute(
                update(Call)
                .where(Call.id.in_(ids), _claimable(now))
                .values(
                    status="claimed",
                    claimed_by=worker,
                    lease_expires_at=now + timedelta(seconds=lease_s),
                    attempts=Call.attempts + 1,
                    started_at=None,
                    first_token_at=None,
                )
                .execution_options(synchronize_session=False)
            )
            rank = {call_id: i for i, call_id in enumerate(ids)}
            calls = sorted(
                s.scalars(select(Call).where(Call.id.in_(ids), Call.claimed_by == worker)),
                key=lambda c: rank[c.id],  # keep the priority order of the candidates
            )
            tenants = dict(
                s.execute(
                    select(Run.id, Run.tenant_id).where(Run.id.in_({c.run_id for c in calls}))
                ).all()
            )
            claimed = []
            for call in calls:
                values = dict(
                    s.execute(
                        select(Variable.name, Variable.value).where(
                            Variable.run_id == call.run_id, Variable.name.in_(call.inputs)
                        )
                    ).all()
                )
                claimed.append(ClaimedCall(call_record(call), tenants[call.run_id], values))
            return claimed

    def hold_call(
        self,
        call_id: int,
        worker: str,
        *,
        engine: str | None = None,
        start: bool = True,
        lease_s: float = 30.0,
        events: Sequence[tuple[str, Any]] = (),
        now: datetime | None = None,
    ) -> bool:
        """Claim one given call for ``worker`` (a manager that schedules calls itself):
        allowed when it is pending, its lease expired, or ``worker`` already holds it.
        With ``start`` it is marked running on ``engine`` (a new attempt); otherwise only
        claimed (to record a failure of a call that never ran). ``events`` are appended in
        the same transaction when the claim succeeds. False when another worker holds it
        or it is finished."""
        now = now or utcnow()
        params = {
            "cid": call_id,
            "worker": worker,
            "now": now,
            "lease": now + timedelta(seconds=lease_s),
            "engine": engine,
        }
        with self._conn_write() as c:
            run_id = c.execute(_HOLD[start], params).scalar()
            if run_id is not None and events:
                append_in(c, [(run_id, t, p) for t, p in events], now)
            return run_id is not None

    def renew_lease(
        self,
        worker: str,
        call_ids: Sequence[int],
        lease_s: float = 30.0,
        now: datetime | None = None,
    ) -> list[int]:
        """Extend the leases ``worker`` still holds; returns the ids it still holds."""
        now = now or utcnow()
        with self._write() as s:
            held = list(
                s.scalars(
                    update(Call)
                    .where(
                        Call.id.in_(list(call_ids)),
                        Call.claimed_by == worker,
                        Call.status.in_(CALL_HELD),
                    )
                    .values(lease_expires_at=now + timedelta(seconds=lease_s))
                    .returning(Call.id)
                    .execution_options(synchronize_session=False)
                )
            )
        return sorted(held)

    def mark_call_started(
        self,
        call_id: int,
        worker: str,
        *,
        engine: str | None = None,
        now: datetime | None = None,
    ) -> bool:
        """The call was sent to an engine; False when ``worker`` no longer holds it."""
        with self._write() as s:
            return _fenced(
                s,
                call_id,
                worker,
                ("claimed",),
                status="running",
                engine=engine,
                started_at=now or utcnow(),
            )

    def mark_call_first_token(
        self, call_id: int, worker: str, *, now: datetime | None = None
    ) -> bool:
        """The first output token arrived; False when ``worker`` no longer holds the call."""
        with self._write() as s:
            return _fenced(s, call_id, worker, ("running",), first_token_at=now or utcnow())

    def finish_call(
        self,
        call_id: int,
        worker: str,
        outputs: Mapping[str, str],
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        first_token_at: datetime | None = None,
        events: Sequence[tuple[str, Any]] = (),
        now: datetime | None = None,
    ) -> FinishResult:
        """Record a call's outputs and mark it done, atomically with ``events``
        (``first_token_at``, when given, is recorded in the same write).

        Rejected (nothing written) when ``worker`` no longer holds the claim. Output
        variables already ready are left as they are: the first recorded value wins.
        """
        now = now or utcnow()
        params = {
            "cid": call_id,
            "worker": worker,
            "now": now,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "first_token_at": first_token_at,
        }
        with self._conn_write() as c:
            row = c.execute(_FINISH, params).first()
            if row is None:
                if c.execute(_CALL_EXISTS, {"cid": call_id}).first() is None:
                    raise NotFoundError(f"no call {call_id}")
                return FinishResult(accepted=False)
            run_id, produces = row
            extra = set(outputs) - set(produces)
            if extra:  # raising rolls the finish back
                raise InvalidRequestError(f"call {call_id} does not produce {sorted(extra)}")
            changed = set_values_in(c, run_id, outputs, now)
            seqs = append_in(c, [(run_id, t, p) for t, p in events], now)
            return FinishResult(True, tuple(changed), tuple(seqs))

    def settle_calls(
        self,
        run_id: str,
        worker: str,
        *,
        events: bool = True,
        now: datetime | None = None,
    ) -> list[str]:
        """Mark done the unfinished calls of a run whose outputs are all ready: their end
        was lost in a crash after their values were committed (recovery does not run them
        again). Calls another worker holds under a live lease are left alone. With
        ``events`` a ``call_finished`` event (``"recovered": true``) is appended for each,
        in the same transaction. Returns the names (or ``#<idx>``) of the calls settled."""
        now = now or utcnow()
        with self._conn_write() as c:
            ready = set(
                c.scalars(
                    select(Variable.__table__.c.name).where(
                        Variable.__table__.c.run_id == run_id,
                        Variable.__table__.c.status == "ready",
                    )
                )
            )
            rows = c.execute(
                select(_C.id, _C.idx, _C.name, _C.outputs)
                .where(_C.run_id == run_id, _C.status.notin_(("done", "failed")))
                .order_by(_C.idx)
            ).all()
            settled = []
            for call_id, idx, name, outputs in rows:
                if not all(o in ready for o in outputs):
                    continue
                done = c.execute(
                    update(_CALLS)
                    .where(
                        _C.id == call_id,
                        or_(
                            _C.status == "pending",
                            and_(
                                _C.status.in_(CALL_HELD),
                                or_(_C.lease_expires_at < now, _C.claimed_by == worker),
                            ),
                        ),
                    )
                    .values(
                        status="done", finished_at=now, lease_expires_at=None, claimed_by=worker
                    )
                ).rowcount
                if done:
                    settled.append(name if name is not None else f"#{idx}")
            if events and settled:
                append_in(
                    c,
                    [(run_id, "call_finished", {"call": n, "recovered": True}) for n in settled],
                    now,
                )
            return settled

    def fail_call(
        self,
        call_id: int,
        worker: str,
        error: str,
        *,
        retry: bool = False,
        events: Sequence[tuple[str, Any]] = (),
        now: datetime | None = None,
    ) -> bool:
        """Record a failure. ``retry`` puts the call back to pending; otherwise it is failed
        and its still-pending outputs become failed. False when ``worker`` lost the claim."""
        now = now or utcnow()
        with self._write() as s:
            call = s.get(Call, call_id)
            if call is None:
                raise NotFoundError(f"no call {call_id}")
            if retry:
                ok = _fenced(
                    s,
                    call_id,
                    worker,
                    CALL_HELD,
                    status="pending",
                    claimed_by=None,
                    lease_expires_at=None,
                    error=error,
                )
            else:
                ok = _fenced(
                    s,
                    call_id,
                    worker,
                    CALL_HELD,
                    status="failed",
                    finished_at=now,
                    lease_expires_at=None,
                    error=error,
                )
                if ok:
                    s.execute(
                        update(Variable)
                        .where(
                            Variable.run_id == call.run_id,
                            Variable.name.in_(call.outputs),
                            Variable.status == "pending",
                        )
                        .values(status="failed", error=error, set_at=now)
                        .execution_options(synchronize_session=False)
                    )
            if ok:
                append_in(s, [(call.run_id, t, p) for t, p in events], now)
            return ok

    def release_expired_claims(self, now: datetime | None = None) -> int:
        """Put calls whose lease expired back to pending; returns how many."""
        with self._write() as s:
            return s.execute(
                update(Call)
                .where(Call.status.in_(CALL_HELD), Call.lease_expires_at < (now or utcnow()))
                .values(status="pending", claimed_by=None, lease_expires_at=None)
                .execution_options(synchronize_session=False)
            ).rowcount

    def release_worker_claims(self, worker: str) -> int:
        """Put back every call held by ``worker`` (a restarted process with a stable id
        releases what its previous life held, without waiting for the leases)."""
        with self._write() as s:
            return s.execute(
                update(Call)
                .where(Call.status.in_(CALL_HELD), Call.claimed_by == worker)
                .values(status="pending", claimed_by=None, lease_expires_at=None)
                .execution_options(synchronize_session=False)
            ).rowcount
