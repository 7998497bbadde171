"""deployments: role ``pinned`` (an agent role served by a frozen checkpoint), ``agent_role``, status ``unpinned``

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = "status IN ('pending', 'active', 'promoted', 'rolled_back', 'failed', 'superseded')"
NEW_STATUSES = "status IN ('pending', 'active', 'promoted', 'rolled_back', 'failed', 'superseded', 'unpinned')"


def upgrade() -> None:
    op.add_column("deployments", sa.Column("agent_role", sa.String(length=64), server_default="", nullable=False))
    op.drop_constraint(op.f("ck_deployments_role_known"), "deployments", type_="check")
    op.create_check_constraint(
        op.f("ck_deployments_role_known"), "deployments", "role IN ('stable', 'canary', 'pinned')"
    )
    op.create_check_constraint(
        op.f("ck_deployments_pin_has_agent_role"), "deployments", "(role = 'pinned') = (agent_role <> '')"
    )
    op.drop_constraint(op.f("ck_deployments_status_known"), "deployments", type_="check")
    op.create_check_constraint(op.f("ck_deployments_status_known"), "deployments", NEW_STATUSES)
    op.drop_index("uq_deployments_active_role", table_name="deployments", postgresql_where=sa.text("status = 'active'"))
    op.create_index(
        "uq_deployments_active_role",
        "deployments",
        ["fleet", "role", "agent_role"],
        unique=True,
        postgresql_where=sa.text("status = 'active'"),
    )


def downgrade() -> None:
    # Pins cannot exist under the old constraints: their rows go (replicas pointing at them
    # first return to no deployment; the reconciler then swaps them to the stable).
    op.execute(
        "UPDATE replicas SET deployment_id = NULL "
        "WHERE deployment_id IN (SELECT id FROM deployments WHERE role = 'pinned')"
    )
    op.execute("DELETE FROM deployments WHERE role = 'pinned'")
    op.drop_index("uq_deployments_active_role", table_name="deployments", postgresql_where=sa.text("status = 'active'"))
    op.create_index(
        "uq_deployments_active_role",
        "deployments",
        ["fleet", "role"],
        unique=True,
        postgresql_where=sa.text("status = 'active'"),
    )
    op.drop_constraint(op.f("ck_deployments_status_known"), "deployments", type_="check")
    op.create_check_constraint(op.f("ck_deployments_status_known"), "deployments", OLD_STATUSES)
    op.drop_constraint(op.f("ck_deployments_pin_has_agent_role"), "deployments", type_="check")
    op.drop_constraint(op.f("ck_deployments_role_known"), "deployments", type_="check")
    op.create_check_constraint(op.f("ck_deployments_role_known"), "deployments", "role IN ('stable', 'canary')")
    op.drop_column("deployments", "agent_role")
