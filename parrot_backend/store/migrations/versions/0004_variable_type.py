"""Variables record their type: `text`, or the constraint a typed output was generated
under (`json_schema`, `regex`, `choice`). Existing variables are text.

Revision ID: 0004_variable_type
Revises: 0003_call_cancelled
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_variable_type"
down_revision = "0003_call_cancelled"
branch_labels = None
depends_on = None

_TYPES = "type IN ('text', 'json_schema', 'regex', 'choice')"


def upgrade() -> None:
    # SQLite: the table is recreated; env.py turns foreign keys off around it, or dropping
    # the old `variables` would delete every `call_inputs` row with it.
    with op.batch_alter_table("variables") as batch:
        batch.add_column(sa.Column("type", sa.String(16), nullable=False, server_default="text"))
        batch.create_check_constraint(op.f("ck_variables_type"), _TYPES)


def downgrade() -> None:
    with op.batch_alter_table("variables") as batch:
        # op.f(): the name as created above (a plain string would get the naming
        # convention's prefix once more, "ck_variables_ck_variables_type", and not be found)
        batch.drop_constraint(op.f("ck_variables_type"), type_="check")
        batch.drop_column("type")
