"""replicas: the serving fleet's members, their weights and routing state

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 15:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("fleet", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("state", sa.String(length=16), server_default="serving", nullable=False),
        sa.Column("policy_version", sa.String(length=128), nullable=True),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("deployment_id", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "state IN ('serving', 'draining', 'swapping', 'failed')", name=op.f("ck_replicas_state_known")
        ),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_replicas_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(
            ["deployment_id"], ["deployments.id"], name=op.f("fk_replicas_deployment_id_deployments")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
        sa.UniqueConstraint("url", name=op.f("uq_replicas_url")),
    )
    op.create_index("ix_replicas_fleet", "replicas", ["fleet"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_replicas_fleet", table_name="replicas")
    op.drop_table("replicas")
