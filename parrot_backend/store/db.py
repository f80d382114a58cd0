"""Database URLs and engines: SQLite (default, WAL) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from parrot_backend.store.errors import DatabaseUrlError

SUPPORTED = ("sqlite", "postgresql")
# Execution option naming a write unit of work; on SQLite it begins with BEGIN IMMEDIATE.
WRITE_OPTION = "parrot_write"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_url() -> str:
    """The default database: ``$PARROT_DATABASE_URL`` or a SQLite file in the user's data dir."""
    env = os.environ.get("PARROT_DATABASE_URL")
    if env:
        return env
    base = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share"))
    return f"sqlite:///{base / 'parrot-backend' / 'parrot.db'}"


def parse_url(url: str | URL) -> URL:
    """Parse and validate a database URL; raise :class:`DatabaseUrlError` with the reason."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise DatabaseUrlError(f"invalid database URL {str(url)!r}: {exc}") from None
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED:
        raise DatabaseUrlError(
            f"unsupported database {backend!r} in URL {parsed.render_as_string()!r}; "
            "use sqlite:///path/to/file.db or postgresql+psycopg://user@host/db"
        )
    if backend == "postgresql" and parsed.get_driver_name() != "psycopg":
        # Normalise postgresql:// to psycopg 3, the driver we ship with.
        parsed = parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise DatabaseUrlError(
            "an in-memory SQLite database cannot be shared or recovered; give a file path"
        )
    return parsed


def sqlite_path(url: URL) -> Path | None:
    """The file behind a SQLite URL, or None for another backend."""
    if url.get_backend_name() != "sqlite":
        return None
    return Path(url.database or "")


def raw_engine(url: URL, **kw: Any) -> Engine:
    """An engine with no session setup at all: used to inspect a database without changing it
    (on SQLite with the store's busy timeout: a writer elsewhere is waited for)."""
    if url.get_backend_name() == "sqlite":
        kw.setdefault("connect_args", {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    try:
        return create_engine(url, poolclass=NullPool, **kw)
    except (NoSuchModuleError, ArgumentError, ImportError) as exc:
        shown = url.render_as_string(hide_password=True)
        raise DatabaseUrlError(f"cannot use database URL {shown!r}: {exc}") from exc


def make_engine(url: URL, pool_size: int = 5) -> Engine:
    """The working engine: WAL + foreign keys + busy timeout on SQLite; a pool on PostgreSQL."""
    if url.get_backend_name() == "sqlite":
        engine = create_engine(
            url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
        )
        _setup_sqlite(engine)
        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def _setup_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module (it would BEGIN lazily, only
        # before DML), so that the "begin" hook below decides how each transaction starts.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # NORMAL is durable across process crashes in WAL mode (only power loss may drop
        # the last commits), and it makes small commits several times faster than FULL.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A write transaction takes the write lock up front: a deferred one that reads and
        # then writes fails at once with SQLITE_BUSY when another writer committed meanwhile,
        # without honouring the busy timeout.
        if conn.get_execution_options().get(WRITE_OPTION):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")
