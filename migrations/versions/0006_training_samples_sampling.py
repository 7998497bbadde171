"""training_samples.sampling: each sample's sampling parameters (the distribution of its behaviour logprobs)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A constant default: Postgres adds the column without rewriting the table, and rows written
    # before read as "nothing recorded" (the trainer assumes trainer.step.sampling_temperature).
    op.add_column(
        "training_samples",
        sa.Column(
            "sampling",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )


def downgrade() -> None:
    op.drop_column("training_samples", "sampling")
