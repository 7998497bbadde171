"""api_keys: product keys (role ``product``, scoped to a project) and their own router rate limits

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 13:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_ROLES = "role IN ('viewer', 'operator', 'admin', 'writer')"
NEW_ROLES = "role IN ('viewer', 'operator', 'admin', 'writer', 'product')"


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("rate_per_s", sa.Float(), nullable=True))
    op.add_column("api_keys", sa.Column("burst", sa.Integer(), nullable=True))
    op.drop_constraint(op.f("ck_api_keys_role_known"), "api_keys", type_="check")
    op.create_check_constraint(op.f("ck_api_keys_role_known"), "api_keys", NEW_ROLES)
    op.create_check_constraint(
        op.f("ck_api_keys_product_has_project"), "api_keys", "role <> 'product' OR project IS NOT NULL"
    )
    op.create_check_constraint(op.f("ck_api_keys_rate_positive"), "api_keys", "rate_per_s IS NULL OR rate_per_s > 0")
    op.create_check_constraint(op.f("ck_api_keys_burst_positive"), "api_keys", "burst IS NULL OR burst >= 1")


def downgrade() -> None:
    # Product keys cannot exist under the old constraint: they go (they only ever opened the router).
    op.execute("DELETE FROM api_keys WHERE role = 'product'")
    op.drop_constraint(op.f("ck_api_keys_burst_positive"), "api_keys", type_="check")
    op.drop_constraint(op.f("ck_api_keys_rate_positive"), "api_keys", type_="check")
    op.drop_constraint(op.f("ck_api_keys_product_has_project"), "api_keys", type_="check")
    op.drop_constraint(op.f("ck_api_keys_role_known"), "api_keys", type_="check")
    op.create_check_constraint(op.f("ck_api_keys_role_known"), "api_keys", OLD_ROLES)
    op.drop_column("api_keys", "burst")
    op.drop_column("api_keys", "rate_per_s")
