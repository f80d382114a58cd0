"""Units of work and ORM-to-record conversion shared by the repository parts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from parrot_backend.store.db import WRITE_OPTION
from parrot_backend.store.models import Call, Run, Tenant, Variable, Workflow
from parrot_backend.store.records import (
    CallRecord,
    RunRecord,
    TenantRecord,
    VariableRecord,
    WorkflowRecord,
)


class StoreBase:
    """Owns the engine; hands out one session per unit of work."""

    engine: Engine

    def _bind(self, engine: Engine) -> None:
        self.engine = engine
        # Records are built before commit, so expiring on commit would only cost reloads.
        reads = engine
        if engine.dialect.name == "postgresql":
            # Several SELECTs of one read (a run's detail) must see one snapshot; a read-only
            # REPEATABLE READ transaction gives that and never fails on serialization.
            reads = engine.execution_options(isolation_level="REPEATABLE READ")
        self._reads = sessionmaker(bind=reads, expire_on_commit=False)
        self._write_engine = engine.execution_options(**{WRITE_OPTION: True})
        self._writes = sessionmaker(bind=self._write_engine, expire_on_commit=False)
        self._batch = threading.local()  # .conn: the open batch of this thread, if any

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.engine.dialect.name

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction: committed on success, rolled back on any error. Inside a
        `batch` it is a savepoint of the batch's transaction instead (one that raises in a
        batch without savepoints still fails the whole batch)."""
        conn = getattr(self._batch, "conn", None)
        if conn is not None:
            try:
                with (
                    Session(
                        bind=conn, expire_on_commit=False, join_transaction_mode="create_savepoint"
                    ) as session,
                    session.begin(),
                ):
                    yield session
            except BaseException:
                if not self._batch.savepoints:  # the same rule as `_conn_write`
                    self._batch.failed = True
                raise
            return
        with self._writes.begin() as session:
            yield session

    @contextmanager
    def _conn_write(self) -> Iterator[Connection]:
        """A write transaction on a plain connection (Core statements only: the hot paths,
        where the ORM session's bookkeeping would cost more than the SQL). Inside a
        `batch` it is a savepoint of the batch's transaction (or, in a batch without
        savepoints, part of it)."""
        batch = self._batch
        conn = getattr(batch, "conn", None)
        if conn is not None:
            if batch.savepoints:
                with conn.begin_nested():
                    yield conn
                return
            try:
                yield conn
            except BaseException:
                batch.failed = True  # what it wrote cannot be undone alone: all or nothing
                raise
            return
        with self._write_engine.begin() as conn:
            yield conn

    @contextmanager
    def batch(self, *, savepoints: bool = True) -> Iterator[None]:
        """Run several store methods as one transaction: on this thread, every write
        method called inside joins it; all are committed together at the end, or none when
        the block raises. With `savepoints` each method is a savepoint, so one that raises
        undoes only itself when the caller catches it. Without (cheaper: a savepoint costs
        about as much as a small statement), a method that raises fails the whole batch:
        nothing is committed even if the caller catches the error (the batch then raises
        `RuntimeError` at its end). Not reentrant."""
        if getattr(self._batch, "conn", None) is not None:
            raise RuntimeError("store batches do not nest")
        with self._write_engine.begin() as conn:
            self._batch.conn, self._batch.savepoints, self._batch.failed = conn, savepoints, False
            try:
                yield
                if self._batch.failed:
                    raise RuntimeError("a store call in this batch failed: nothing was written")
            finally:
                self._batch.conn = None

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """A read-only transaction (one consistent snapshot on both backends)."""
        with self._reads.begin() as session:
            yield session


def tenant_record(t: Tenant) -> TenantRecord:
    """Convert an ORM tenant."""
    return TenantRecord(id=t.id, name=t.name, created_at=t.created_at)


def workflow_record(w: Workflow) -> WorkflowRecord:
    """Convert an ORM workflow."""
    return WorkflowRecord(
        id=w.id,
        tenant_id=w.tenant_id,
        name=w.name,
        version=w.version,
        program=w.program,
        public=w.public,
        created_at=w.created_at,
    )


def run_record(r: Run) -> RunRecord:
    """Convert an ORM run (summary fields)."""
    return RunRecord(
        id=r.id,
        tenant_id=r.tenant_id,
        workflow_id=r.workflow_id,
        status=r.status,
        open=r.open,
        objectives=dict(r.objectives or {}),
        created_at=r.created_at,
        finished_at=r.finished_at,
        replay_of=r.replay_of,
        error=r.error,
        waits=dict(r.waits or {}),
        stated=r.stated,
    )


def variable_record(v: Variable) -> VariableRecord:
    """Convert an ORM variable."""
    return VariableRecord(
        name=v.name,
        status=v.status,
        value=v.value,
        producer_call=v.producer_call,
        set_at=v.set_at,
        error=v.error,
        type=v.type,
    )


def call_record(c: Call) -> CallRecord:
    """Convert an ORM call."""
    return CallRecord(
        id=c.id,
        run_id=c.run_id,
        idx=c.idx,
        name=c.name,
        inputs=tuple(c.inputs),
        outputs=tuple(c.outputs),
        status=c.status,
        engine=c.engine,
        objective=c.objective,
        task_group=c.task_group,
        claimed_by=c.claimed_by,
        lease_expires_at=c.lease_expires_at,
        attempts=c.attempts,
        queued_at=c.queued_at,
        started_at=c.started_at,
        first_token_at=c.first_token_at,
        finished_at=c.finished_at,
        prompt_tokens=c.prompt_tokens,
        completion_tokens=c.completion_tokens,
        error=c.error,
    )
