"""batches.expired_at: when a batch not done by its expires_at was ended as `expired`

The reconciler now enforces a batch's completion window: a batch still in progress at expires_at has its
unfinished jobs cancelled and is finalized as `expired` (OpenAI's Batch API status), stamped here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "expired_at")
