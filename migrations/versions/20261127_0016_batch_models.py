"""batches.models: the served models a batch's requests run on, in the order its file first names them, so that
its Batch object reports the model of its requests (`model`), not the fleet's default. NULL: a batch created
before (its object names the fleet's default, as it did).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 06:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("models", postgresql.ARRAY(sa.String(length=128)), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "models")
