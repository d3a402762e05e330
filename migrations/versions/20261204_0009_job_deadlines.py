"""a job's deadline (issue 44): POST /jobs' `deadline`, a batch's jobs the end of its completion window

Nullable, no default: adding it rewrites nothing. The partial index holds only live jobs with a deadline
(the /metrics count of those past or near it); a progress write touches neither its column nor its
predicate, so it stays a heap-only update (migration 0008).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE_WITH_DEADLINE = sa.text("deadline IS NOT NULL AND status IN ('queued', 'running')")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("deadline", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_live_deadline", "jobs", ["deadline"], postgresql_where=LIVE_WITH_DEADLINE)


def downgrade() -> None:
    op.drop_index("ix_jobs_live_deadline", table_name="jobs", postgresql_where=LIVE_WITH_DEADLINE)
    op.drop_column("jobs", "deadline")
