"""index of queued jobs sent to Redis, by priority and send time, for the reconciler's unclaimed-message check

Every run the reconciler looks for queued jobs of each priority sent before the messages still waiting in
that priority's Redis list (their message was taken, and nobody claimed the job: workers/unclaimed.py).
This index keeps that a short range scan over queued rows, however many finished jobs the table holds.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHERE = sa.text("status = 'queued' AND enqueued_at IS NOT NULL")


def upgrade() -> None:
    op.create_index("ix_jobs_queued_sent", "jobs", ["priority", "enqueued_at"], postgresql_where=WHERE)


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_sent", table_name="jobs", postgresql_where=WHERE)
