"""Alembic environment: runs only on a connection handed over by ``store.schema``.

There is no alembic.ini; the store builds the Config in code and passes an open
connection in ``config.attributes["connection"]``.

SQLite: batch migrations rebuild a table (create a copy, DROP the old one, rename the
copy). With foreign keys on, that DROP deletes the table's rows first and so cascades:
rebuilding `variables` or `calls` deleted every `call_inputs` row, rebuilding `runs`
every run's variables, calls and events. So foreign keys are turned off while migrations
run (as SQLite's documentation prescribes for such table rebuilds) and checked with
``PRAGMA foreign_key_check`` before the migration transaction commits: a violation fails
the migration, which rolls back. The pragma has no effect inside a transaction, so a
SQLite connection with foreign keys on must be handed over outside one
(``schema.upgrade`` does); this file then begins and commits the transaction itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from alembic import context
from sqlalchemy import Connection

from parrot_backend.store.errors import StoreError
from parrot_backend.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through parrot_backend.store.schema.upgrade(url)")


def _pragma(dbapi_conn: Any, statement: str) -> Any:
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(statement)
        row = cursor.fetchone()
        return row[0] if row else None
    finally:
        cursor.close()


@contextlib.contextmanager
def _sqlite_foreign_keys_off(conn: Connection) -> Iterator[None]:
    """Foreign keys off on this SQLite connection for the block (restored after it), and the
    block inside a transaction that this function commits (unless the caller holds one)."""
    # On the DBAPI connection: a statement through SQLAlchemy would begin a transaction first.
    dbapi_conn = conn.connection.driver_connection
    was_on = bool(_pragma(dbapi_conn, "PRAGMA foreign_keys"))
    if was_on:
        if conn.in_transaction() or dbapi_conn.in_transaction:
            raise StoreError(
                "SQLite migrations need foreign keys off, which cannot be switched inside a "
                "transaction: hand the connection over outside one (rebuilding a table with "
                "foreign keys on would cascade-delete the rows that refer to it)"
            )
        _pragma(dbapi_conn, "PRAGMA foreign_keys=OFF")
        if _pragma(dbapi_conn, "PRAGMA foreign_keys"):
            raise StoreError("could not turn SQLite foreign keys off for the migration")
    try:
        begin = contextlib.nullcontext() if conn.in_transaction() else conn.begin()
        with begin:
            yield
            _check_foreign_keys(conn)
    finally:
        if was_on:
            _pragma(dbapi_conn, "PRAGMA foreign_keys=ON")


def _check_foreign_keys(conn: Connection) -> None:
    """Raise (rolling the migration back) when any row refers to a missing parent."""
    violations = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
    if violations:
        shown = ", ".join(
            f"{table} rowid {rowid} -> {parent}" for table, rowid, parent, _ in violations[:10]
        )
        raise StoreError(
            f"migration left {len(violations)} foreign key violation(s) ({shown}); "
            "not committing it: repair those rows (or restore a backup), then upgrade again"
        )


def _run(conn: Connection) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables when needed.
        render_as_batch=conn.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


if connection.dialect.name == "sqlite":
    with _sqlite_foreign_keys_off(connection):
        _run(connection)  # configured inside the transaction: Alembic leaves it to us
else:
    _run(connection)
