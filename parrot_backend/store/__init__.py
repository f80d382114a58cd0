"""SQL store: programs, runs, semantic variables, calls and a resumable event log.

SQLite file by default (WAL), PostgreSQL by URL (``postgresql+psycopg://...``); the
schema is managed by Alembic migrations shipped in ``store/migrations``.

Protocol and guarantees
-----------------------
*Write before acknowledge.* Every state change (a run created, a variable set, a call
finished, an event) is committed by one :class:`Store` method before the caller
acknowledges it to a client or streams it. Token deltas may be buffered and written with
:meth:`Store.append_events` in batches; nothing is streamed before its batch commits.
(The server's persister also buffers a call's end, which nothing acknowledges: its
outputs are committed first, and :meth:`Store.settle_calls` records an end lost in a
crash.) :meth:`Store.batch` makes several methods one transaction.

*At-least-once call execution.* A call is executed under a claim with a lease
(:meth:`Store.claim_calls`). After a crash the claim expires (or is released) and the call
runs again, so a call may execute more than once.

*Output recorded once, observed once.* :meth:`Store.finish_call` records outputs only for
the worker that holds the claim, and a variable goes from ``pending`` to ``ready`` exactly
once (a conditional UPDATE); a second execution's output is discarded. Events passed with
a state change are written in the same transaction and only when the change happened, so
clients observe each value once; event ids (``seq``) are gap-free and increasing per run,
and :meth:`Store.read_events` resumes exactly after a ``Last-Event-ID``.

*A ready variable is never recomputed.* Recovery (:meth:`Store.unfinished_runs`) returns
ready values; only calls not done are claimable again, and their ready outputs are kept.

Tenant isolation: every read made on behalf of a client takes the tenant id; a run of
another tenant is reported as not found. Worker operations (claims, recovery) span tenants.
"""

from __future__ import annotations

from parrot_backend.store.errors import (
    DatabaseUrlError,
    ForeignDatabaseError,
    InvalidRequestError,
    NotFoundError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StoreError,
)
from parrot_backend.store.records import (
    CallRecord,
    ClaimedCall,
    EventRecord,
    FinishResult,
    RunDetail,
    RunRecord,
    TenantRecord,
    UnfinishedRun,
    VariableRecord,
    WorkflowRecord,
)
from parrot_backend.store.schema import SchemaState, check, head_revision, inspect_database, upgrade
from parrot_backend.store.store import Store

__all__ = [
    "CallRecord",
    "ClaimedCall",
    "DatabaseUrlError",
    "EventRecord",
    "FinishResult",
    "ForeignDatabaseError",
    "InvalidRequestError",
    "NotFoundError",
    "RunDetail",
    "RunRecord",
    "SchemaOutdatedError",
    "SchemaState",
    "SchemaTooNewError",
    "Store",
    "StoreError",
    "TenantRecord",
    "UnfinishedRun",
    "VariableRecord",
    "WorkflowRecord",
    "check",
    "head_revision",
    "inspect_database",
    "upgrade",
]
