"""GET /jobs/ended (issue 41): a tenant's jobs in the order they ended

A job's finished_at is written once, when it ends (the same write changes its status, which other indexes
hold already), so a progress write stays a heap-only update (migration 0008).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 00:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENDED = sa.text("finished_at IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_jobs_tenant_finished", "jobs", ["tenant_id", "finished_at", "id"], postgresql_where=ENDED
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_finished", table_name="jobs", postgresql_where=ENDED)
