"""tenant policies (issue 41): per-tenant priority cap, /v1 default priority, queued and rate limits, token
budget; a tenant without a row keeps the API's defaults

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 00:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_policies",
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("top_priority", sa.SmallInteger(), nullable=True),
        sa.Column("sync_priority", sa.SmallInteger(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("rate_limit", sa.String(length=200), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("budget_period_seconds", sa.Integer(), server_default=sa.text("86400"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint(
            "top_priority BETWEEN 0 AND 9", name=op.f("ck_tenant_policies_top_priority_range")
        ),
        sa.CheckConstraint(
            "sync_priority BETWEEN 0 AND 9", name=op.f("ck_tenant_policies_sync_priority_range")
        ),
        sa.CheckConstraint("max_queued >= 0", name=op.f("ck_tenant_policies_max_queued_positive")),
        sa.CheckConstraint("token_budget >= 0", name=op.f("ck_tenant_policies_token_budget_positive")),
        sa.CheckConstraint(
            "budget_period_seconds > 0", name=op.f("ck_tenant_policies_budget_period_positive")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_policies_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_policies")),
    )


def downgrade() -> None:
    op.drop_table("tenant_policies")
