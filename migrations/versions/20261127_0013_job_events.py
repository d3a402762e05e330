"""jobs.events (issue 41, the admin page's timeline): what a job lived that its columns keep no time of, as a
JSON list appended by the statements that write the row anyway: re-claims, preemptions inside the engine and
resumes, hand-backs, lease expiries. NULL (every row written before, and a job that ran straight through)
means none

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 03:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # no rewrite (NULL default), and no index on it: a progress write that appends to it stays heap-only
    op.add_column("jobs", sa.Column("events", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "events")
