"""Runs record what clients wait for beyond their declared outputs: the outputs stated
with calls added later and the variables polled with `perf` (`waits`: variable ->
criterion), and whether a client stated any criterion (`stated`), so that a resumed run
is deduced the same objectives. Existing runs have none recorded.

Revision ID: 0005_run_waits
Revises: 0004_variable_type
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_run_waits"
down_revision = "0004_variable_type"
branch_labels = None
depends_on = None

# a frozen copy of the column type (plain JSON on PostgreSQL too, as in 0001)
JSON = sa.JSON()

# Plain ALTER TABLE, not a batch: on SQLite a batch with a SQL-expression default copies
# the table, and dropping the old one (foreign keys on) would delete every run's variables,
# calls and events with it.


def upgrade() -> None:
    op.add_column("runs", sa.Column("waits", JSON, nullable=True))
    op.add_column(
        "runs", sa.Column("stated", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    op.drop_column("runs", "stated")  # SQLite 3.35+ drops a column in place
    op.drop_column("runs", "waits")
