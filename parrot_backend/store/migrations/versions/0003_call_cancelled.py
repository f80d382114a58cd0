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
# 0001 named the constraint "ck_calls_status" without op.f(), so the naming convention
# prefixed it once more: it is "ck_calls_ck_calls_status" on every database at 0002. This
# revision names its own "ck_calls_status"; the downgrade restores 0001's name. Names are
# given in full with op.f() (taken as is; a plain string would be prefixed again).
_OLD_NAME = "ck_calls_ck_calls_status"
_NEW_NAME = "ck_calls_status"


def _swap(drop: str, create: str, condition: str) -> None:
    # SQLite: the table is recreated; env.py turns foreign keys off around it, or dropping
    # the old `calls` would delete every `call_inputs` row with it.
    with op.batch_alter_table("calls") as batch:
        batch.drop_constraint(op.f(drop), type_="check")
        batch.create_check_constraint(op.f(create), condition)


def upgrade() -> None:
    _swap(_OLD_NAME, _NEW_NAME, _NEW)


def downgrade() -> None:
    op.execute("UPDATE calls SET status = 'failed' WHERE status = 'cancelled'")
    _swap(_NEW_NAME, _OLD_NAME, _OLD)
