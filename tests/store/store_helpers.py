"""Shared helpers of the store tests (a unique module name: test dirs are not packages)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

PG_ENV = "PARROT_TEST_DATABASE_URL"
PG_URL = os.environ.get(PG_ENV)
BACKENDS = [
    "sqlite",
    pytest.param(
        "postgresql",
        marks=[pytest.mark.postgres, pytest.mark.skipif(not PG_URL, reason=f"{PG_ENV} unset")],
    ),
]


def url_text(url: URL) -> str:
    """A URL as a string with its password (for subprocesses)."""
    return url.render_as_string(hide_password=False)


def pg_schema_url(schema: str) -> URL:
    """The test database URL with ``search_path`` set to ``schema``."""
    assert PG_URL
    return make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})


def pg_admin(sql: str) -> None:
    """Run a statement on the test database outside any test schema."""
    engine = create_engine(PG_URL)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


def chain_calls(n: int) -> list[dict]:
    """Descriptors of a chain x0 -> c0 -> x1 -> c1 -> ... -> xn."""
    return [{"name": f"c{i}", "inputs": [f"x{i}"], "outputs": [f"x{i + 1}"]} for i in range(n)]


def fan_calls(n: int) -> list[dict]:
    """Descriptors of n independent calls reading ``q`` (all ready at once)."""
    return [{"name": f"f{i}", "inputs": ["q"], "outputs": [f"a{i}"]} for i in range(n)]
