"""Alembic environment: runs only on a connection handed over by ``store.schema``.

There is no alembic.ini; the store builds the Config in code and passes an open
connection in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from parrot_backend.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through parrot_backend.store.schema.upgrade(url)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds tables when needed.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
