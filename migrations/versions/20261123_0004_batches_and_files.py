"""the Batch API: files (in chunks), batches, and jobs.batch_id / batch_index

A batch's input file and its output and error files live in Postgres, cut into chunks so they stream in
and out without being held whole in memory. Each line of a batch becomes a job carrying the batch's id
and the line's index. A batch's queued jobs no longer count towards the per-tenant cap of POST /jobs
(ix_jobs_queued_tenant leaves them out).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)


def _ts(name: str, **kwargs) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), **kwargs)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        _ts("created_at", server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index(
        "ix_files_tenant_created", "files", ["tenant_id", sa.text("created_at DESC"), sa.text("id DESC")]
    )
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name="fk_file_chunks_file_id_files", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("file_id", "seq", name="pk_file_chunks"),
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(*BATCH_STATUSES, name="status", native_enum=False, create_constraint=True, length=16),
            nullable=False,
        ),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("metadata", postgresql.JSONB(), nullable=True),
        sa.Column("errors", postgresql.JSONB(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        _ts("created_at", server_default=sa.text("now()"), nullable=False),
        *(
            _ts(name, nullable=True)
            for name in (
                "in_progress_at",
                "expires_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "cancelling_at",
                "cancelled_at",
            )
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index(
        "ix_batches_tenant_created", "batches", ["tenant_id", sa.text("created_at DESC"), sa.text("id DESC")]
    )
    op.create_index(
        "ix_batches_live",
        "batches",
        ["status"],
        postgresql_where=sa.text("status IN ('in_progress', 'cancelling')"),
    )
    op.add_column("jobs", sa.Column("batch_id", sa.String(40), nullable=True))
    op.add_column("jobs", sa.Column("batch_index", sa.Integer(), nullable=True))
    op.create_foreign_key(
        "fk_jobs_batch_id_batches", "jobs", "batches", ["batch_id"], ["id"], ondelete="CASCADE"
    )
    op.create_index(
        "ix_jobs_batch", "jobs", ["batch_id", "batch_index"], postgresql_where=sa.text("batch_id IS NOT NULL")
    )
    op.drop_index("ix_jobs_queued_tenant", table_name="jobs")
    op.create_index(
        "ix_jobs_queued_tenant",
        "jobs",
        ["tenant_id"],
        postgresql_where=sa.text("status = 'queued' AND batch_id IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_tenant", table_name="jobs")
    op.create_index(
        "ix_jobs_queued_tenant", "jobs", ["tenant_id"], postgresql_where=sa.text("status = 'queued'")
    )
    op.drop_index("ix_jobs_batch", table_name="jobs")
    op.drop_constraint("fk_jobs_batch_id_batches", "jobs", type_="foreignkey")
    op.drop_column("jobs", "batch_index")
    op.drop_column("jobs", "batch_id")
    op.drop_table("batches")
    op.drop_table("file_chunks")
    op.drop_table("files")
