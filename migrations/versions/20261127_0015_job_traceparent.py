"""jobs.traceparent (issue 42, traces): the W3C traceparent of the API request that created the job, so that
each worker's spans of the job join that request's trace, whichever worker holds it and however often it is
handed back or recovered (the row, not the queue message, carries it). NULL: no trace (tracing off, every
row written before)

Revision ID: 0015
Revises: 0013
Create Date: 2026-11-27 03:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("traceparent", sa.String(length=128), nullable=True))  # no rewrite


def downgrade() -> None:
    op.drop_column("jobs", "traceparent")
