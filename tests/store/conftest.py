"""Fixtures: a fresh store per test on SQLite (always) and PostgreSQL (when configured).

PostgreSQL tests need ``PARROT_TEST_DATABASE_URL`` (e.g.
``postgresql+psycopg://postgres@127.0.0.1:5432/test``). They run in a schema created for
this test session and dropped afterwards, and tables are emptied before each test.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from store_helpers import BACKENDS, PG_ENV, PG_URL, pg_admin, pg_schema_url

from parrot_backend.store import Store, upgrade
from parrot_backend.store.models import Base


@pytest.fixture()
def pg_fresh_schema() -> Iterator[URL]:
    """An empty, private PostgreSQL schema for one test (dropped afterwards)."""
    if not PG_URL:
        pytest.skip(f"{PG_ENV} unset")
    name = f"parrot_t_{uuid.uuid4().hex[:12]}"
    pg_admin(f'CREATE SCHEMA "{name}"')
    try:
        yield pg_schema_url(name)
    finally:
        pg_admin(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[URL]:
    """A migrated PostgreSQL schema shared by the repository tests of this session."""
    name = f"parrot_s_{uuid.uuid4().hex[:12]}"
    pg_admin(f'CREATE SCHEMA "{name}"')
    url = pg_schema_url(name)
    try:
        upgrade(url)
        yield url
    finally:
        pg_admin(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied for each test (faster than migrating each time)."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    upgrade(f"sqlite:///{path}")
    # Fold the WAL back into the main file so that copying the one file copies everything.
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> URL:
    """URL of an empty, migrated database on each backend."""
    if request.param == "sqlite":
        path = tmp_path / "store.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return make_url(f"sqlite:///{path}")
    url = request.getfixturevalue("pg_session_url")
    engine = create_engine(url)
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


@pytest.fixture()
def store(db_url: URL) -> Iterator[Store]:
    """A Store on an empty, migrated database."""
    s = Store(db_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture()
def tenant(store: Store) -> int:
    """Id of a fresh tenant."""
    record, _ = store.create_tenant(f"t-{uuid.uuid4().hex[:8]}")
    return record.id
