"""jobs.options and jobs.logprobs: the request's vLLM/OpenAI sampling options, and the log probabilities
its caller asked for

`options` holds the sampling fields beyond the columns every job has (ignore_eos, stop_token_ids,
logprobs, echo, penalties...), only those that differ from their defaults: most rows hold `{}`.
`logprobs` holds the result's log probabilities (prompt and output tokens) when the request asked for them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column("options", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    op.add_column("jobs", sa.Column("logprobs", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "logprobs")
    op.drop_column("jobs", "options")
