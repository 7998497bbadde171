"""operations: the admin API's deployment actions, run in the background and followed by id

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operations",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("fleet", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column(
            "params", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_s", sa.Float(), nullable=False),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", sa.String(length=32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'succeeded', 'failed')", name=op.f("ck_operations_state_known")
        ),
        sa.CheckConstraint("lease_s > 0", name=op.f("ck_operations_lease_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
    )
    op.create_index("ix_operations_created_at", "operations", ["created_at"], unique=False)
    op.create_index(
        "uq_operations_active_fleet",
        "operations",
        ["fleet"],
        unique=True,
        postgresql_where=sa.text("state IN ('queued', 'running')"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_operations_active_fleet",
        table_name="operations",
        postgresql_where=sa.text("state IN ('queued', 'running')"),
    )
    op.drop_index("ix_operations_created_at", table_name="operations")
    op.drop_table("operations")
