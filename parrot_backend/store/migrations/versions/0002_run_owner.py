"""Run ownership: the manager process that runs a run, and until when its claim holds.

Revision ID: 0002_run_owner
Revises: 0001_initial
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from parrot_backend.store.columns import UTCDateTime

revision = "0002_run_owner"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(200), nullable=True))
        batch.add_column(sa.Column("owner_lease_expires_at", UTCDateTime(), nullable=True))


def downgrade() -> None:
    # SQLite: dropping columns recreates `runs`; env.py turns foreign keys off around it, or
    # dropping the old table would delete every run's variables, calls and events with it.
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("owner_lease_expires_at")
        batch.drop_column("owner")
