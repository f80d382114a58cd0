"""Schema versioning: inspect a database, refuse what is unsafe, upgrade with Alembic.

Nothing here writes to a database it has not recognised as ours (or as empty): a
foreign or corrupt file, or a schema newer than this code, raises before any write.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from parrot_backend.store.db import WRITE_OPTION, make_engine, parse_url, raw_engine, sqlite_path
from parrot_backend.store.errors import (
    DatabaseUrlError,
    ForeignDatabaseError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StoreError,
)

MIGRATIONS = Path(__file__).with_name("migrations")
SQLITE_MAGIC = b"SQLite format 3\x00"
# Any constant works; it only has to be the same for every process upgrading one database.
PG_UPGRADE_LOCK = 0x5041_5252_4F54  # "PARROT"

SchemaStatus = Literal["empty", "current", "outdated", "newer", "foreign"]


@dataclass(frozen=True, slots=True)
class SchemaState:
    """What a database holds: its Alembic revision and how it compares with this code."""

    status: SchemaStatus
    revision: str | None
    head: str
    tables: frozenset[str]


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config built in code (no alembic.ini), optionally bound to a connection."""
    cfg = Config()
    # configparser interpolates '%', which may occur in an install path.
    cfg.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this code knows."""
    heads = _scripts().get_heads()
    if len(heads) != 1:
        raise StoreError(f"migrations have {len(heads)} heads; expected one")
    return heads[0]


def known_revisions() -> frozenset[str]:
    """Every revision id this code knows."""
    return frozenset(s.revision for s in _scripts().walk_revisions())


def _check_sqlite_file(path: Path) -> bool:
    """True when the file exists with content; raise when it is not a SQLite database."""
    if path.is_dir():
        raise DatabaseUrlError(f"database path {str(path)!r} is a directory")
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as fh:
        magic = fh.read(len(SQLITE_MAGIC))
    if magic != SQLITE_MAGIC:
        raise ForeignDatabaseError(
            f"{str(path)!r} is not a SQLite database (corrupt or another kind of file); "
            "refusing to use it. Point the store at a new path or restore the file."
        )
    return True


def inspect_database(url: str | URL) -> SchemaState:
    """Read the schema state without writing anything; raise on unusable databases."""
    parsed = parse_url(url)
    head = head_revision()
    path = sqlite_path(parsed)
    if path is not None and not _check_sqlite_file(path):
        return SchemaState("empty", None, head, frozenset())
    engine = raw_engine(parsed)
    try:
        with engine.connect() as conn:
            tables = frozenset(inspect(conn).get_table_names())
            revision = None
            if "alembic_version" in tables:
                rows = conn.execute(text("SELECT version_num FROM alembic_version")).all()
                if len(rows) > 1:
                    raise ForeignDatabaseError(
                        f"database has {len(rows)} Alembic heads; it is not a parrot store"
                    )
                revision = rows[0][0] if rows else None
    except DBAPIError as exc:
        raise _classify(parsed, exc) from exc
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot inspect database {_show(parsed)}: {exc}") from exc
    finally:
        engine.dispose()
    ours = tables - {"alembic_version"}
    if revision is None:
        if ours:
            raise ForeignDatabaseError(
                f"database {_show(parsed)} holds tables {sorted(ours)[:8]} but no parrot "
                "schema version; refusing to touch another application's data"
            )
        return SchemaState("empty", None, head, tables)
    if revision == head:
        return SchemaState("current", revision, head, tables)
    if revision in known_revisions():
        return SchemaState("outdated", revision, head, tables)
    return SchemaState("newer", revision, head, tables)


def check(url: str | URL) -> SchemaState:
    """Require the schema to be exactly current; raise a clear error otherwise. Never writes."""
    state = inspect_database(url)
    _refuse_newer(url, state)
    if state.status == "empty":
        raise SchemaOutdatedError(
            f"database {_show(parse_url(url))} has no parrot schema and upgrades are disabled; "
            "run with schema upgrades enabled to create it"
        )
    if state.status == "outdated":
        raise SchemaOutdatedError(
            f"database schema is at revision {state.revision}, this code needs {state.head}; "
            "upgrades are disabled: back up the database and start with upgrades enabled"
        )
    return state


_THREAD_LOCK = threading.Lock()  # flock is per open file: threads of one process wait here


@contextlib.contextmanager
def _sqlite_upgrade_lock(path: Path) -> Iterator[None]:
    """Serialize schema upgrades of one SQLite file across threads and processes.

    Two servers starting together on a new file raced: one converting it to WAL or
    migrating while the other inspected it could fail with "database is locked" (the
    busy handler does not cover every step). The lock file sits beside the database."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _THREAD_LOCK, open(f"{path}.upgrade-lock", "a+b") as fh:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the busy timeout is all there is
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def upgrade(url: str | URL) -> SchemaState:
    """Create or upgrade the schema to the head revision (what the server does at start).
    Concurrent upgrades of one database wait for each other, then find it current."""
    parsed = parse_url(url)
    path = sqlite_path(parsed)
    if path is None:
        return _upgrade(parsed)
    if path.is_dir():
        raise DatabaseUrlError(f"database path {str(path)!r} is a directory")
    with _sqlite_upgrade_lock(path):
        return _upgrade(parsed)


def _upgrade(parsed: URL) -> SchemaState:
    state = inspect_database(parsed)
    _refuse_newer(parsed, state)
    if state.status == "current":
        return state
    path = sqlite_path(parsed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(parsed, pool_size=1)
    try:
        with engine.connect().execution_options(**{WRITE_OPTION: True}) as conn:
            if conn.dialect.name == "postgresql":
                with conn.begin():
                    # Two servers starting together: the second waits, then finds head.
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_UPGRADE_LOCK})
                    command.upgrade(alembic_config(conn), "head")
            else:
                # SQLite: handed over outside a transaction, so that migrations/env.py can
                # turn foreign keys off (a no-op inside one) before it begins the transaction
                # (BEGIN IMMEDIATE: this connection writes) and commits it.
                command.upgrade(alembic_config(conn), "head")
    except DBAPIError as exc:
        raise _classify(parsed, exc) from exc
    finally:
        engine.dispose()
    return inspect_database(parsed)


def _refuse_newer(url: str | URL, state: SchemaState) -> None:
    if state.status == "newer":
        raise SchemaTooNewError(
            f"database {_show(parse_url(url))} has schema revision {state.revision!r}, which "
            f"this code does not know (its newest is {state.head!r}): it was written by a "
            "newer parrot-backend. Upgrade the software; the database was left untouched."
        )


def _show(url: URL) -> str:
    return repr(url.render_as_string(hide_password=True))


def _classify(url: URL, exc: DBAPIError) -> StoreError:
    message = str(exc.orig) if exc.orig is not None else str(exc)
    if "file is not a database" in message or "malformed" in message:
        return ForeignDatabaseError(f"database {_show(url)} is corrupt or not SQLite: {message}")
    if exc.connection_invalidated or "connect" in message.lower() or "unable to open" in message:
        return DatabaseUrlError(f"cannot connect to database {_show(url)}: {message}")
    return StoreError(f"database error on {_show(url)}: {message}")
