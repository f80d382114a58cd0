"""Initial schema: tenants, api keys, workflows, runs, variables, calls, events.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from parrot_backend.store.columns import UTCDateTime

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copies of the column types at this revision (later model changes need new revisions).
# Plain JSON on PostgreSQL too: JSONB would reorder object keys (see store.columns).
JSON = sa.JSON()
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, UTCDateTime(), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "workflows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("program", JSON, nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_workflows"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_workflows_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.UniqueConstraint(
            "tenant_id", "name", "version", name="uq_workflows_tenant_id_name_version"
        ),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("workflow_id", sa.Integer(), nullable=True),
        sa.Column("program", JSON, nullable=False),
        sa.Column("inputs", JSON, nullable=False),
        sa.Column("objectives", JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("open", sa.Boolean(), nullable=False),
        _ts("created_at"),
        _ts("finished_at", nullable=True),
        sa.Column("replay_of", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_runs_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["workflow_id"],
            ["workflows.id"],
            name="fk_runs_workflow_id_workflows",
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["replay_of"], ["runs.id"], name="fk_runs_replay_of_runs", ondelete="SET NULL"
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed', 'cancelled')",
            name="ck_runs_status",
        ),
    )
    op.create_index("ix_runs_tenant_id_created_at", "runs", ["tenant_id", "created_at"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_table(
        "variables",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("value", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("producer_call", sa.Integer(), nullable=True),
        _ts("set_at", nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_variables"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_variables_run_id_runs", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("run_id", "name", name="uq_variables_run_id_name"),
        sa.CheckConstraint("status IN ('pending', 'ready', 'failed')", name="ck_variables_status"),
    )
    op.create_table(
        "calls",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("inputs", JSON, nullable=False),
        sa.Column("outputs", JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("engine", sa.String(200), nullable=True),
        sa.Column("objective", sa.String(16), nullable=True),
        sa.Column("task_group", sa.String(200), nullable=True),
        sa.Column("claimed_by", sa.String(200), nullable=True),
        _ts("lease_expires_at", nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _ts("queued_at"),
        _ts("started_at", nullable=True),
        _ts("first_token_at", nullable=True),
        _ts("finished_at", nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_calls"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_calls_run_id_runs", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("run_id", "idx", name="uq_calls_run_id_idx"),
        sa.CheckConstraint(
            "status IN ('pending', 'claimed', 'running', 'done', 'failed')",
            name="ck_calls_status",
        ),
    )
    op.create_index("ix_calls_status_lease_expires_at", "calls", ["status", "lease_expires_at"])
    op.create_table(
        "call_inputs",
        sa.Column("call_id", sa.Integer(), nullable=False),
        sa.Column("variable_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("call_id", "variable_id", name="pk_call_inputs"),
        sa.ForeignKeyConstraint(
            ["call_id"], ["calls.id"], name="fk_call_inputs_call_id_calls", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["variable_id"],
            ["variables.id"],
            name="fk_call_inputs_variable_id_variables",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_call_inputs_variable_id", "call_inputs", ["variable_id"])
    op.create_table(
        "events",
        sa.Column("id", BIGID, nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("payload", JSON, nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_events_run_id_runs", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("run_id", "seq", name="uq_events_run_id_seq"),
    )
    op.create_index("ix_events_created_at", "events", ["created_at"])


def downgrade() -> None:
    for table in (
        "events",
        "call_inputs",
        "calls",
        "variables",
        "runs",
        "workflows",
        "api_keys",
        "tenants",
    ):
        op.drop_table(table)
