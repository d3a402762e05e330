"""jobs.handbacks: how often a full worker handed the job back for more urgent work

Queue-level preemption (workers/intake.py) hands the least urgent held job back to Redis when a more
urgent one waits; the count bounds how often one job pays for that.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("handbacks", sa.SmallInteger(), server_default=sa.text("0"), nullable=False)
    )


def downgrade() -> None:
    op.drop_column("jobs", "handbacks")
