"""The ORM tables (SQLAlchemy 2.x typed declarative).

The migration in ``migrations/versions`` creates exactly these; a test compares the two.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from parrot_backend.store.columns import (
    CALL_STATUSES,
    RUN_STATUSES,
    VARIABLE_STATUSES,
    JSONType,
    UTCDateTime,
    ValueText,
    utcnow,
)

# Deterministic constraint names so that migrations can refer to them on every backend.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# What a variable's value is: free text, or the constraint its producer generated it under
# (program/generation.py `ValueType`; the constraint itself is in the run's program).
VALUE_TYPES = ("text", "json_schema", "regex", "choice")

# SQLite only autoincrements INTEGER PRIMARY KEY; BIGINT elsewhere for the event log.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base carrying the naming convention."""

    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    """A customer; every run, workflow and key belongs to one."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    """An API key, stored as its SHA-256 digest only."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # A few leading characters, so that an operator can tell keys apart without the secret.
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Workflow(Base):
    """A named, versioned program of a tenant."""

    __tablename__ = "workflows"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(Integer)
    program: Mapped[dict[str, Any]] = mapped_column(JSONType)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Run(Base):
    """One execution of a program with input values."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        Index("ix_runs_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_runs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    workflow_id: Mapped[int | None] = mapped_column(
        ForeignKey("workflows.id", ondelete="SET NULL"), nullable=True
    )
    program: Mapped[dict[str, Any]] = mapped_column(JSONType)
    inputs: Mapped[dict[str, Any]] = mapped_column(JSONType)
    objectives: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # What clients wait for beyond `objectives` (variable -> criterion: outputs stated with
    # calls added later, variables polled with `perf`), and whether a client stated any
    # criterion: the manager deduces objectives from all three (migration 0005)
    waits: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    stated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    status: Mapped[str] = mapped_column(String(16), default="pending")
    open: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    replay_of: Mapped[str | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"), nullable=True
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Last event seq handed out; bumping it under the row lock serialises appenders per run.
    event_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    # The manager process running this run (several may share one database) and until when
    # its claim holds without renewal; an expired owner's runs are adopted by another.
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    owner_lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Variable(Base):
    """A semantic variable of a run."""

    __tablename__ = "variables"
    __table_args__ = (
        UniqueConstraint("run_id", "name"),
        CheckConstraint(_in("status", VARIABLE_STATUSES), name="status"),
        CheckConstraint(_in("type", VALUE_TYPES), name="type"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    value: Mapped[str | None] = mapped_column(ValueText, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    # Index of the producing call within the run; NULL for inputs set by the client.
    producer_call: Mapped[int | None] = mapped_column(Integer, nullable=True)
    set_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # `text`, or the type of a typed output (`json_schema`, `regex`, `choice`): a value of
    # a typed variable matches its producer's constraint (migration 0004)
    type: Mapped[str] = mapped_column(String(16), default="text", server_default="text")


class Call(Base):
    """One template instance (LLM request) of a run, with its claim and timings."""

    __tablename__ = "calls"
    __table_args__ = (
        UniqueConstraint("run_id", "idx"),
        CheckConstraint(_in("status", CALL_STATUSES), name="status"),
        Index("ix_calls_status_lease_expires_at", "status", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    inputs: Mapped[list[str]] = mapped_column(JSONType)
    outputs: Mapped[list[str]] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    engine: Mapped[str | None] = mapped_column(String(200), nullable=True)
    objective: Mapped[str | None] = mapped_column(String(16), nullable=True)
    task_group: Mapped[str | None] = mapped_column(String(200), nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    queued_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class CallInput(Base):
    """Edge of the DAG: a call reads a variable. Lets SQL decide readiness (all inputs ready)."""

    __tablename__ = "call_inputs"

    call_id: Mapped[int] = mapped_column(
        ForeignKey("calls.id", ondelete="CASCADE"), primary_key=True
    )
    variable_id: Mapped[int] = mapped_column(
        ForeignKey("variables.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class Event(Base):
    """One entry of a run's event log; ``seq`` is the SSE event id."""

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("run_id", "seq"),
        Index("ix_events_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[Any] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
