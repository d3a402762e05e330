"""ix_jobs_tenant_succeeded: a tenant's succeeded jobs in the order they ended, for the output-length history
(jobstore/output_length.py: the last 32 to finish before a job was created). Its conditions and its order are all
this index's (tenant, succeeded, finished before; by finished_at then id), so its plan reads 32 rows and no sort.
Without it, on a table grown fast since its last ANALYZE (a fresh stack under genq-batch), the planner took the
index by tenant and status and sorted every succeeded job of the tenant for each job: 99 ms a job at 10,000 jobs.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 07:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_tenant_succeeded",
        "jobs",
        ["tenant_id", "finished_at", "id"],
        postgresql_where=sa.text("status = 'succeeded'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_succeeded", table_name="jobs")
