"""deployments.strategy names any registered swap strategy (plug-ins of flywheel.swap_strategies)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 19:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint(op.f("ck_deployments_strategy_known"), "deployments", type_="check")
    op.create_check_constraint(op.f("ck_deployments_strategy_named"), "deployments", "strategy ~ '^[a-z][a-z0-9_]*$'")


def downgrade() -> None:
    # Refused while a deployment names a plug-in strategy other than the two built in.
    op.drop_constraint(op.f("ck_deployments_strategy_named"), "deployments", type_="check")
    op.create_check_constraint(op.f("ck_deployments_strategy_known"), "deployments", "strategy IN ('full', 'lora')")
