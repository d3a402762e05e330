"""progress writes as heap-only updates: no index holds lease_expires_at, and jobs pages keep room

A worker writes every running job's new tokens and lease every PROGRESS_INTERVAL. The lease's expiry was
the key of the reconciler's index of running jobs, so each of those writes added an entry to every index
that covers a running job (five or six: the primary key, the tenant's three, this one, a batch's). Keyed
by worker_id instead (which a progress write leaves alone), the index still gives the reconciler the
running jobs (a few thousand at most; it filters their leases), and Postgres can write the new row
version on the same page without touching an index (a HOT update), when the page has room:
fillfactor 80 keeps a fifth of each new page free. Measured on 256 running jobs, 8 writes of 16 tokens each:
Postgres CPU 1.83 -> 0.92 µs a token (bench/RESULTS.md, issue 25). Existing pages fill to 80% as they are
rewritten.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNING = sa.text("status = 'running'")


def upgrade() -> None:
    op.create_index("ix_jobs_running_worker", "jobs", ["worker_id"], postgresql_where=RUNNING)
    op.drop_index("ix_jobs_running_lease", table_name="jobs", postgresql_where=RUNNING)
    op.execute("ALTER TABLE jobs SET (fillfactor = 80)")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs RESET (fillfactor)")
    op.create_index("ix_jobs_running_lease", "jobs", ["lease_expires_at"], postgresql_where=RUNNING)
    op.drop_index("ix_jobs_running_worker", table_name="jobs", postgresql_where=RUNNING)
