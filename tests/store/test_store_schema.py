"""Migrations and refusals: the schema matches the models, and bad databases are left alone."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, func, inspect, select, text
from sqlalchemy.engine import URL
from store_helpers import PG_URL, chain_calls

from parrot_backend.store import (
    DatabaseUrlError,
    ForeignDatabaseError,
    SchemaOutdatedError,
    SchemaTooNewError,
    Store,
    StoreError,
    check,
    head_revision,
    upgrade,
)
from parrot_backend.store import schema as schema_mod
from parrot_backend.store.models import Base, CallInput


def snapshot(path: Path) -> dict[str, str]:
    """Hashes of a SQLite file and its -wal/-shm companions (absent ones included)."""
    out = {}
    for suffix in ("", "-wal", "-shm", "-journal"):
        p = Path(f"{path}{suffix}")
        out[suffix] = hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "absent"
    return out


def refuse_everywhere(url: str | URL, error: type[StoreError]) -> None:
    """Opening, checking and upgrading all raise ``error``."""
    with pytest.raises(error):
        Store(url)
    with pytest.raises(error):
        Store(url, upgrade=False)
    with pytest.raises(error):
        check(url)
    with pytest.raises(error):
        upgrade(url)


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | URL:
    """An empty database of each backend."""
    if request.param == "sqlite":
        return _sqlite_url(tmp_path / "a.db")
    return request.getfixturevalue("pg_fresh_schema")


def test_migration_0005_keeps_runs_with_their_variables_calls_and_events(fresh_url) -> None:
    """Runs written before 0005 (down to 0004 and up again, as the server upgrades: foreign
    keys on) keep what hangs off them, and have no waits recorded."""
    with Store(fresh_url) as store:
        tenant, _ = store.create_tenant("acme")
        detail = store.create_run(
            tenant.id, {"calls": []}, chain_calls(2), {"x0": "a"}, {"x2": "latency"}
        )
        run_id = detail.run.id
        store.append_event(run_id, "run_created", {})
    engine = create_engine(fresh_url)
    with engine.begin() as conn:
        command.downgrade(schema_mod.alembic_config(conn), "0004_variable_type")
    engine.dispose()
    assert upgrade(fresh_url).status == "current"
    with Store(fresh_url) as store:
        kept = store.get_run(tenant.id, run_id)
        assert set(kept.variables) == {"x0", "x1", "x2"}
        assert [c.name for c in kept.calls] == ["c0", "c1"]
        assert [e.type for e in store.read_events(tenant.id, run_id)] == ["run_created"]
        with store._read() as s:
            assert s.scalar(select(func.count()).select_from(CallInput)) == 2
        assert kept.run.objectives == {"x2": "latency"}
        assert (kept.run.waits, kept.run.stated) == ({}, False)


def test_migration_creates_exactly_the_models_sqlite(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path / "a.db")
    state = upgrade(url)
    assert state.status == "current" and state.revision == head_revision()
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()
    assert check(url).status == "current"
    assert upgrade(url).status == "current"  # idempotent


@pytest.mark.postgres
def test_migration_creates_exactly_the_models_pg(pg_fresh_schema: URL) -> None:
    upgrade(pg_fresh_schema)
    engine = create_engine(pg_fresh_schema)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()
    assert check(pg_fresh_schema).status == "current"


def test_sqlite_session_settings(tmp_path: Path) -> None:
    with Store(_sqlite_url(tmp_path / "a.db")) as store:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_missing_database_without_upgrade_is_refused_and_not_created(tmp_path: Path) -> None:
    path = tmp_path / "new" / "a.db"
    with pytest.raises(SchemaOutdatedError, match="upgrades are disabled"):
        Store(_sqlite_url(path), upgrade=False)
    assert not path.exists()
    with Store(_sqlite_url(path)):  # with upgrades (the default) it is created
        pass
    assert check(_sqlite_url(path)).status == "current"


@pytest.mark.parametrize(
    "content",
    [
        b"hello, this is my shopping list\n" * 100,
        b"SQLite format 3\x00" + b"\xff" * 4000,
    ],
    ids=["text-file", "corrupt-sqlite"],
)
def test_corrupt_file_is_refused_untouched(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "parrot.db"
    path.write_bytes(content)
    before = snapshot(path)
    refuse_everywhere(_sqlite_url(path), ForeignDatabaseError)
    assert snapshot(path) == before
    assert path.read_bytes() == content


def test_foreign_sqlite_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
    conn.execute("INSERT INTO users (email) VALUES ('a@example.com')")
    conn.commit()
    conn.close()
    before = snapshot(path)
    with pytest.raises(ForeignDatabaseError, match="users"):
        Store(_sqlite_url(path))
    refuse_everywhere(_sqlite_url(path), ForeignDatabaseError)
    assert snapshot(path) == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


def _stamp(url: str | URL, revision: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_newer_schema_is_refused_untouched_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    url = _sqlite_url(path)
    with Store(url) as store:
        tenant, key = store.create_tenant("acme")
    _stamp(url, "9999_from_the_future")
    before = snapshot(path)
    with pytest.raises(SchemaTooNewError, match="9999_from_the_future"):
        Store(url)
    refuse_everywhere(url, SchemaTooNewError)
    assert snapshot(path) == before


@pytest.mark.postgres
def test_newer_schema_and_foreign_tables_refused_pg(pg_fresh_schema: URL) -> None:
    upgrade(pg_fresh_schema)
    _stamp(pg_fresh_schema, "9999_from_the_future")
    refuse_everywhere(pg_fresh_schema, SchemaTooNewError)
    engine = create_engine(pg_fresh_schema)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
            "9999_from_the_future"
        )
        conn.execute(text("DROP TABLE alembic_version"))
    refuse_everywhere(pg_fresh_schema, ForeignDatabaseError)
    with engine.connect() as conn:
        assert "alembic_version" not in inspect(conn).get_table_names()
    engine.dispose()


NEXT_REVISION = """
from alembic import op
import sqlalchemy as sa

revision = "9999_test_extra"
down_revision = "{down}"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("extra_things", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade():
    op.drop_table("extra_things")
"""


def install_newer_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Pretend the code ships one more revision than the database has; returns its id."""
    migrations = tmp_path / "migrations"
    shutil.copytree(schema_mod.MIGRATIONS, migrations, ignore=shutil.ignore_patterns("__pycache__"))
    current = head_revision()
    (migrations / "versions" / "9999_test_extra.py").write_text(
        NEXT_REVISION.replace("{down}", current)
    )
    monkeypatch.setattr(schema_mod, "MIGRATIONS", migrations)
    return "9999_test_extra"


def test_outdated_schema_refused_without_upgrade_then_upgraded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.db"
    url = _sqlite_url(path)
    with Store(url) as store:
        tenant, key = store.create_tenant("acme")
    before = snapshot(path)
    old_head = head_revision()
    new_head = install_newer_code(tmp_path, monkeypatch)
    assert head_revision() == new_head
    with pytest.raises(SchemaOutdatedError, match=old_head):
        Store(url, upgrade=False)
    with pytest.raises(SchemaOutdatedError):
        check(url)
    assert snapshot(path) == before
    with Store(url) as store:  # the server's default: upgrade at start
        assert store.schema.revision == new_head
        assert store.tenant_for_key(key) == tenant  # data kept across the upgrade
        with store.engine.connect() as conn:
            assert "extra_things" in inspect(conn).get_table_names()


@pytest.mark.parametrize(
    "url",
    [
        "mysql://root@localhost/db",
        "definitely not a url",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql+psycopg://postgres@127.0.0.1:1/test",
    ],
)
def test_wrong_urls_are_clear_errors(url: str) -> None:
    with pytest.raises(DatabaseUrlError):
        Store(url)


def test_directory_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUrlError, match="directory"):
        Store(_sqlite_url(tmp_path))


@pytest.mark.postgres
@pytest.mark.skipif(not PG_URL, reason="needs PostgreSQL")
def test_missing_pg_database_is_a_clear_error() -> None:
    from sqlalchemy.engine import make_url

    assert PG_URL
    url = make_url(PG_URL).set(database="parrot_no_such_database")
    with pytest.raises(DatabaseUrlError, match="parrot_no_such_database"):
        Store(url)


def _concurrent_upgrades(url: str | URL) -> None:
    errors: list[BaseException] = []

    def go() -> None:
        try:
            upgrade(url)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [
            head_revision()
        ]
    engine.dispose()


def test_concurrent_upgrades_sqlite(tmp_path: Path) -> None:
    _concurrent_upgrades(_sqlite_url(tmp_path / "a.db"))


@pytest.mark.postgres
def test_concurrent_upgrades_pg(pg_fresh_schema: URL) -> None:
    _concurrent_upgrades(pg_fresh_schema)


def _upgrade_in_process(url: str) -> None:
    upgrade(url)


def test_concurrent_upgrades_from_processes_wait_for_each_other_sqlite(tmp_path: Path) -> None:
    """Servers starting together on a new SQLite file: each upgrade waits for the one in
    progress (a lock file beside the database), none fails with "database is locked"."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for round_ in range(2):
        url = _sqlite_url(tmp_path / f"r{round_}.db")
        with ctx.Pool(4) as pool:
            pool.map(_upgrade_in_process, [url] * 4)  # raises if any upgrade raised
        assert check(url).status == "current"
