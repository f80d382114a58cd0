"""Calls of a cancelled run are recorded as cancelled (before, they stayed 'running').

Revision ID: 0003_call_cancelled
Revises: 0002_run_owner
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0003_call_cancelled"
down_revision = "0002_run_owner"
branch_labels = None
depends_on = None

_OLD = "status IN ('pending', 'claimed', 'running', 'done', 'failed')"
_NEW = "status IN ('pending', 'claimed', 'running', 'done', 'failed', 'cancelled')"


def _swap(condition: str) -> None:
    with op.batch_alter_table("calls") as batch:  # SQLite: the table is recreated
        batch.drop_constraint("ck_calls_status", type_="check")
        batch.create_check_constraint(op.f("ck_calls_status"), condition)


def upgrade() -> None:
    _swap(_NEW)


def downgrade() -> None:
    op.execute("UPDATE calls SET status = 'failed' WHERE status = 'cancelled'")
    _swap(_OLD)
