"""Variables record their type (text, or a typed output's constraint kind) on SQLite and
PostgreSQL; migration 0004 adds the column with existing variables as text."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, text

from parrot_backend.store import InvalidRequestError, Store, upgrade
from parrot_backend.store.schema import alembic_config

PROGRAM = {"calls": [{"template": "{{input:q}} {{output:a}} {{output:b}}"}], "public": False}


def test_typed_outputs_are_recorded_and_read_back(store: Store, tenant: int) -> None:
    calls = [
        {"name": "c", "inputs": ["q"], "outputs": ["a", "b"], "types": {"a": "json_schema"}},
        {"name": "d", "inputs": ["a"], "outputs": ["r"], "types": {"r": "choice"}},
    ]
    detail = store.create_run(tenant, PROGRAM, calls, {"q": "hi"})
    assert {n: v.type for n, v in detail.variables.items()} == {
        "q": "text",
        "a": "json_schema",
        "b": "text",
        "r": "choice",
    }
    store.set_variable(detail.run.id, "a", '{"x": 1}')
    got = store.get_variable(tenant, detail.run.id, "a")
    assert (got.type, got.value, got.status) == ("json_schema", '{"x": 1}', "ready")


def test_calls_added_to_an_open_run_type_their_outputs(store: Store, tenant: int) -> None:
    run = store.create_run(
        tenant, PROGRAM, [{"inputs": ["q"], "outputs": ["a"]}], {"q": "x"}, open=True
    ).run.id
    # `later` is named as an input first (pending, no producer), then produced by a regex
    store.add_calls(tenant, run, [{"inputs": ["later"], "outputs": ["z"]}])
    store.add_calls(
        tenant, run, [{"inputs": ["a"], "outputs": ["later"], "types": {"later": "regex"}}]
    )
    detail = store.get_run(tenant, run)
    assert detail.variables["later"].type == "regex" and detail.variables["z"].type == "text"
    assert detail.variables["later"].producer_call == 2


@pytest.mark.parametrize(
    ("types", "message"),
    [
        ({"a": "xml"}, "must be one of"),
        ({"nope": "regex"}, "not an output"),
        (["a"], "must map outputs"),
    ],
)
def test_bad_types_are_refused(store: Store, tenant: int, types, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        store.create_run(tenant, PROGRAM, [{"inputs": [], "outputs": ["a"], "types": types}])


def test_migration_0004_keeps_existing_variables_as_text(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0003_call_cancelled")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (id, name, created_at) VALUES (1, 't', '2026-01-01 00:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO runs (id, tenant_id, program, inputs, objectives, status, open, "
                "created_at, event_seq) VALUES ('r1', 1, '{}', '{}', '{}', 'pending', 0, "
                "'2026-01-01 00:00:00', 0)"
            )
        )
        conn.execute(
            text("INSERT INTO variables (run_id, name, status) VALUES ('r1', 'v', 'pending')")
        )
    engine.dispose()
    upgrade(url)
    store = Store(url)
    try:
        assert store.get_run(1, "r1").variables["v"].type == "text"
    finally:
        store.close()
