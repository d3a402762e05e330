"""index of queued jobs by tenant, for the queued-job caps of POST /jobs

Without it the caps counted every job ever stored (a sequential scan per submission).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_queued_tenant",
        "jobs",
        ["tenant_id"],
        unique=False,
        postgresql_where=sa.text("status = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_tenant", table_name="jobs", postgresql_where=sa.text("status = 'queued'"))
