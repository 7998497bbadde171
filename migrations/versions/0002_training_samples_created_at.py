"""index training samples by creation time (the trainer's data window)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 13:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_training_samples_created_at", "training_samples", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_training_samples_created_at", table_name="training_samples")
