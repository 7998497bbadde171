"""pending_feedback and a completion-id index: feedback by completion id alone

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pending_feedback",
        sa.Column("event_id", sa.UUID(), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("completion_id", sa.UUID(), nullable=False),
        sa.Column("completion_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=True),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_pending_feedback")),
    )
    op.create_index(
        "ix_pending_feedback_due",
        "pending_feedback",
        ["next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("published_at IS NULL"),
    )
    # Built without CONCURRENTLY (inside the migration's transaction): it locks raw_events against
    # writes while it builds, so apply it while the consumers are stopped on a large table, or
    # create it by hand with CREATE INDEX CONCURRENTLY first (the name is the same).
    op.execute(
        "CREATE INDEX IF NOT EXISTS ix_raw_events_completion_id ON raw_events "
        "((payload ->> 'completion_id'), occurred_at) WHERE type = 'completion'"
    )


def downgrade() -> None:
    op.drop_index("ix_raw_events_completion_id", table_name="raw_events")
    op.drop_index("ix_pending_feedback_due", table_name="pending_feedback")
    op.drop_table("pending_feedback")
