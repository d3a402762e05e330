"""jobs name their model (issue 40): the served name of the model a job runs on; NULL (every row written before)
is the fleet's default model, whose queue is the plain `generate`

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 01:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("model", sa.String(length=200), nullable=True)
    )  # no rewrite: NULL default


def downgrade() -> None:
    op.drop_column("jobs", "model")
