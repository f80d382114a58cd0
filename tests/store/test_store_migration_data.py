"""Migrations keep stored rows: upgrading from an old revision, and downgrading step by step.

On SQLite, batch migrations rebuild a table (copy, DROP, rename); with foreign keys on, the
DROP cascaded and deleted every row referring to the table (a `variables` rebuild emptied
`call_inputs`, a `runs` rebuild emptied nearly everything). These tests write a full set of
rows at one revision, migrate the way the server does (`schema.upgrade`, foreign keys on)
or downgrade on a store engine (foreign keys on as well), and compare every row.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, MetaData, create_engine, inspect, select, text
from sqlalchemy.engine import URL

from parrot_backend.store import Store, StoreError, head_revision, upgrade
from parrot_backend.store.db import make_engine, parse_url
from parrot_backend.store.schema import alembic_config

T0 = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
T1 = datetime(2026, 1, 2, 3, 5, 0, tzinfo=UTC)
PROGRAM = {"calls": [{"name": "c0", "inputs": ["x0"], "outputs": ["x1"]}]}

# Rows as of the head revision, parents first; columns a revision lacks are left out when
# writing at that revision. Every row differs from its siblings in some content column.
ROWS: dict[str, list[dict[str, Any]]] = {
    "tenants": [
        {"id": 1, "name": "acme", "created_at": T0},
        {"id": 2, "name": "other", "created_at": T1},
    ],
    "api_keys": [
        {
            "id": 1,
            "tenant_id": 1,
            "key_hash": "a" * 64,
            "prefix": "pk_a",
            "created_at": T0,
            "revoked_at": None,
        },
        {
            "id": 2,
            "tenant_id": 2,
            "key_hash": "b" * 64,
            "prefix": "pk_b",
            "created_at": T0,
            "revoked_at": T1,
        },
    ],
    "workflows": [
        {
            "id": 1,
            "tenant_id": 1,
            "name": "wf",
            "version": 1,
            "program": PROGRAM,
            "public": True,
            "created_at": T0,
        },
    ],
    "runs": [
        {
            "id": "r1",
            "tenant_id": 1,
            "workflow_id": 1,
            "program": {"calls": [{"name": "c0"}, {"name": "c1"}], "note": "héllo ✓"},
            "inputs": {"x0": "héllo"},
            "objectives": {"x2": "latency"},
            "status": "running",
            "open": True,
            "created_at": T0,
            "finished_at": None,
            "replay_of": None,
            "error": None,
            "event_seq": 3,
            "owner": "manager-1",
            "owner_lease_expires_at": T1,
            "waits": {"x1": "throughput"},
            "stated": True,
        },
        {
            "id": "r2",
            "tenant_id": 1,
            "workflow_id": None,
            "program": PROGRAM,
            "inputs": {"y0": "q"},
            "objectives": {},
            "status": "cancelled",
            "open": False,
            "created_at": T1,
            "finished_at": T1,
            "replay_of": "r1",
            "error": "cancelled by client",
            "event_seq": 1,
            "owner": None,
            "owner_lease_expires_at": None,
            "waits": None,
            "stated": False,
        },
        {
            "id": "r3",
            "tenant_id": 2,
            "workflow_id": None,
            "program": PROGRAM,
            "inputs": {"z0": "z"},
            "objectives": {"z1": "latency"},
            "status": "failed",
            "open": False,
            "created_at": T1,
            "finished_at": T1,
            "replay_of": None,
            "error": "boom",
            "event_seq": 0,
            "owner": None,
            "owner_lease_expires_at": None,
            "waits": None,
            "stated": False,
        },
    ],
    "variables": [
        *(
            {
                "id": i + 1,
                "run_id": run,
                "name": name,
                "value": value,
                "status": status,
                "producer_call": producer,
                "set_at": T1 if status != "pending" else None,
                "error": error,
                "type": vtype,
            }
            for i, (run, name, value, status, producer, error, vtype) in enumerate(
                [
                    ("r1", "x0", "héllo", "ready", None, None, "text"),
                    ("r1", "x1", '{"a": 1}', "ready", 0, None, "json_schema"),
                    ("r1", "x2", None, "pending", 1, None, "regex"),
                    ("r2", "y0", "q", "ready", None, None, "text"),
                    ("r2", "y1", None, "failed", 0, "cancelled", "choice"),
                    ("r3", "z0", "z", "ready", None, None, "text"),
                    ("r3", "z1", None, "failed", 0, "boom", "text"),
                ]
            )
        )
    ],
    "calls": [
        *(
            {
                "id": i + 1,
                "run_id": run,
                "idx": idx,
                "name": name,
                "inputs": inputs,
                "outputs": outputs,
                "status": status,
                "engine": "tiny" if status != "pending" else None,
                "objective": "latency",
                "task_group": None,
                "claimed_by": "worker-1" if status == "running" else None,
                "lease_expires_at": T1 if status == "running" else None,
                "attempts": attempts,
                "queued_at": T0,
                "started_at": T0 if status != "pending" else None,
                "first_token_at": None,
                "finished_at": T1 if status in ("done", "failed", "cancelled") else None,
                "prompt_tokens": 7 if status == "done" else None,
                "completion_tokens": 3 if status == "done" else None,
                "error": "boom" if status == "failed" else None,
            }
            for i, (run, idx, name, inputs, outputs, status, attempts) in enumerate(
                [
                    ("r1", 0, "c0", ["x0"], ["x1"], "done", 1),
                    ("r1", 1, "c1", ["x0", "x1"], ["x2"], "running", 2),
                    ("r2", 0, "d0", ["y0"], ["y1"], "cancelled", 1),
                    ("r3", 0, "e0", ["z0"], ["z1"], "failed", 3),
                ]
            )
        )
    ],
    "call_inputs": [
        {"call_id": 1, "variable_id": 1},
        {"call_id": 2, "variable_id": 1},
        {"call_id": 2, "variable_id": 2},
        {"call_id": 3, "variable_id": 4},
        {"call_id": 4, "variable_id": 6},
    ],
    "events": [
        {"id": 1, "run_id": "r1", "seq": 1, "type": "run_created", "payload": {}, "created_at": T0},
        {
            "id": 2,
            "run_id": "r1",
            "seq": 2,
            "type": "call_finished",
            "payload": {"call": 0, "tokens": [1, 2, 3]},
            "created_at": T1,
        },
        {
            "id": 3,
            "run_id": "r1",
            "seq": 3,
            "type": "token",
            "payload": {"text": "héllo ✓"},
            "created_at": T1,
        },
        {
            "id": 4,
            "run_id": "r2",
            "seq": 1,
            "type": "run_cancelled",
            "payload": {},
            "created_at": T1,
        },
    ],
}
TABLES = list(ROWS)
REVISIONS = [
    "0001_initial",
    "0002_run_owner",
    "0003_call_cancelled",
    "0004_variable_type",
    "0005_run_waits",
]
# The columns each revision adds to existing tables, and what an existing row reads there.
ADDED = {
    "0002_run_owner": {"runs": {"owner": None, "owner_lease_expires_at": None}},
    "0004_variable_type": {"variables": {"type": "text"}},
    "0005_run_waits": {"runs": {"waits": None, "stated": False}},
}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | URL:
    """An empty database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'a.db'}"
    return request.getfixturevalue("pg_fresh_schema")


def _reflect(conn: Connection) -> MetaData:
    meta = MetaData()
    meta.reflect(conn, only=[t for t in TABLES if t in inspect(conn).get_table_names()])
    return meta


def _revision(conn: Connection) -> str | None:
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def write_rows(url: str | URL) -> None:
    """Insert ROWS, with the columns the database's current revision has."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            meta = _reflect(conn)
            for name, rows in ROWS.items():
                table = meta.tables[name]
                conn.execute(table.insert(), [{k: r[k] for k in table.c.keys()} for r in rows])
    finally:
        engine.dispose()


def _utc(value: Any) -> Any:
    """SQLite reads a timestamp back naive (the store writes UTC there)."""
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def read_rows(url: str | URL) -> tuple[str | None, dict[str, list[dict[str, Any]]]]:
    """The revision, and every row of every store table still there, in primary key order."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            meta = _reflect(conn)
            out = {}
            for name, table in meta.tables.items():
                query = select(table).order_by(*table.primary_key.columns)
                out[name] = [
                    {k: _utc(v) for k, v in row._mapping.items()} for row in conn.execute(query)
                ]
            return _revision(conn), out
    finally:
        engine.dispose()


def expected_rows(name: str, columns: list[str], written_at: str, cancelled: str) -> list[dict]:
    """ROWS[name] as they should read now: with the table's current columns, the columns
    added after the revision they were written at holding their defaults, and calls that
    were cancelled having status ``cancelled``."""
    out = []
    for row in ROWS[name]:
        row = dict(row)
        for revision in REVISIONS[REVISIONS.index(written_at) + 1 :]:
            row.update(ADDED.get(revision, {}).get(name, {}))
        if name == "calls" and row["status"] == "cancelled":
            row["status"] = cancelled
        out.append({k: row[k] for k in columns})
    return out


def assert_all_rows_kept(
    url: str | URL, revision: str | None, written_at: str, cancelled: str = "cancelled"
) -> dict[str, list[dict[str, Any]]]:
    """Every table of ``revision`` holds exactly the rows of ROWS written at ``written_at``."""
    got_revision, tables = read_rows(url)
    assert got_revision == revision
    assert {n: len(rows) for n, rows in tables.items()} == {n: len(ROWS[n]) for n in tables}
    for name, rows in tables.items():  # table by table, for a readable failure
        assert rows == expected_rows(name, list(rows[0]), written_at, cancelled), name
    return tables


def schema_names(url: str | URL) -> dict[str, dict[str, list[str | None]]]:
    """The names of each store table's constraints and indexes."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            return {
                table: {
                    "check": sorted(c["name"] for c in insp.get_check_constraints(table)),
                    "unique": sorted(c["name"] for c in insp.get_unique_constraints(table)),
                    "fk": sorted(c["name"] for c in insp.get_foreign_keys(table)),
                    "index": sorted(i["name"] for i in insp.get_indexes(table)),
                }
                for table in TABLES
            }
    finally:
        engine.dispose()


def downgrade_on_store_engine(url: str | URL, revision: str) -> None:
    """Downgrade on the store's own engine (SQLite: foreign keys on), outside a transaction."""
    engine = make_engine(parse_url(url))
    try:
        with engine.connect() as conn:
            command.downgrade(alembic_config(conn), revision)
            if conn.dialect.name == "sqlite":  # switched back on for the connection's next use
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_upgrade_from_0003_keeps_every_row(fresh_url) -> None:
    """A database at 0003 holding runs with variables, calls, DAG edges and events is
    upgraded to head the way the server does (foreign keys on): every row survives with its
    content, and the columns added since read as their defaults."""
    engine = create_engine(fresh_url)
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0003_call_cancelled")
    engine.dispose()
    write_rows(fresh_url)
    assert_all_rows_kept(fresh_url, "0003_call_cancelled", "0003_call_cancelled")

    assert upgrade(fresh_url).status == "current"

    tables = assert_all_rows_kept(fresh_url, head_revision(), "0003_call_cancelled")
    assert set(tables) == set(TABLES)
    with Store(fresh_url) as store:  # and the store reads them as before
        detail = store.get_run(1, "r1")
        assert {n: v.value for n, v in detail.variables.items()} == {
            "x0": "héllo",
            "x1": '{"a": 1}',
            "x2": None,
        }
        assert [(c.name, c.status) for c in detail.calls] == [("c0", "done"), ("c1", "running")]
        assert [e.type for e in store.read_events(1, "r1")] == [
            "run_created",
            "call_finished",
            "token",
        ]
        assert store.get_run(1, "r2").calls[0].status == "cancelled"


def test_downgrade_step_by_step_keeps_rows_then_upgrades_again(fresh_url) -> None:
    """From head, each downgrade step (on the store's engine: foreign keys on) keeps every row
    of the tables that remain (0003's downgrade marks cancelled calls failed, as it says);
    upgrading back from 0001 as the server does keeps them too; down to the base and up
    again gives a current, empty schema."""
    assert upgrade(fresh_url).status == "current"
    write_rows(fresh_url)
    head = head_revision()
    assert_all_rows_kept(fresh_url, head, head)
    names = schema_names(fresh_url)

    for revision in reversed(REVISIONS[:-1]):
        downgrade_on_store_engine(fresh_url, revision)
        cancelled = "failed" if revision < "0003" else "cancelled"
        tables = assert_all_rows_kept(fresh_url, revision, head, cancelled)
        assert set(tables) == set(TABLES)

    assert upgrade(fresh_url).status == "current"  # 0001 -> head, as the server does
    assert_all_rows_kept(fresh_url, head, "0001_initial", "failed")
    assert schema_names(fresh_url) == names  # the same constraints as before the round trip

    downgrade_on_store_engine(fresh_url, "base")
    revision, tables = read_rows(fresh_url)
    assert (revision, tables) == (None, {})
    assert upgrade(fresh_url).status == "current"
    assert read_rows(fresh_url) == (head, {name: [] for name in TABLES})


def test_sqlite_upgrade_with_a_dangling_reference_fails_and_rolls_back(tmp_path: Path) -> None:
    """Foreign keys are off while SQLite tables are rebuilt, so the migration checks them
    before committing: a row referring to a missing parent (here written with foreign keys
    off) fails the upgrade loudly, and the database stays at its revision with its rows."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    engine = create_engine(url)  # a plain engine: SQLite's default, foreign keys off
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0003_call_cancelled")
    engine.dispose()
    write_rows(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO call_inputs (call_id, variable_id) VALUES (1, 99)"))
    engine.dispose()
    _, before = read_rows(url)

    with pytest.raises(StoreError, match=r"1 foreign key violation.*call_inputs"):
        upgrade(url)

    assert read_rows(url) == ("0003_call_cancelled", before)


def test_sqlite_connection_with_foreign_keys_on_in_a_transaction_is_refused(
    tmp_path: Path,
) -> None:
    """Foreign keys cannot be switched off inside a transaction: migrating on such a
    connection is refused before anything is changed (it would cascade-delete rows)."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    assert upgrade(url).status == "current"
    write_rows(url)
    _, before = read_rows(url)
    engine = make_engine(parse_url(url))
    try:
        with engine.begin() as conn:
            with pytest.raises(StoreError, match="outside"):
                command.downgrade(alembic_config(conn), "0003_call_cancelled")
    finally:
        engine.dispose()
    assert read_rows(url) == (head_revision(), before)
