"""Database tables: tenants, their policies and API keys (hashed), jobs, and the Batch API's files and batches."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    TypeDecorator,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Constraint names are derived, so migrations can refer to them and autogenerate stays stable.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Utf8Text(TypeDecorator):
    """Text kept as UTF-8 bytes (bytea), so NUL characters survive: Postgres `text` refuses them, and
    prompts and model outputs may contain any character."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: bytes | None, dialect) -> str | None:
        # surrogateescape: a corrupted (non-UTF-8) row still loads, and check_job_row refuses it,
        # instead of the row failing to load and its job staying stuck in `queued`
        return None if value is None else bytes(value).decode("utf-8", errors="surrogateescape")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class BatchStatus(str, enum.Enum):
    """A batch's status, as OpenAI's Batch API names them."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


def _status_enum(enum_class: type[enum.Enum], name: str) -> Enum:
    """A string column holding one of `enum_class`'s values, checked by a constraint (no native enum)."""
    return Enum(
        enum_class,
        name=name,
        native_enum=False,
        length=16,
        create_constraint=True,
        values_callable=lambda e: [m.value for m in e],
    )


def _timestamp(**kwargs) -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), **kwargs)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = _timestamp(server_default=func.now())


class TenantPolicy(Base):
    """A tenant's limits (jobstore/tenant_policy.py); a column left NULL takes the API's default (settings),
    and a tenant without a row has every default: today's behaviour."""

    __tablename__ = "tenant_policies"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    # the most urgent priority its keys may ask for (0 most urgent): a more urgent one answers 403
    top_priority: Mapped[int | None] = mapped_column(SmallInteger)
    # the priority of its synchronous /v1 calls that name none (default 0, never above top_priority)
    sync_priority: Mapped[int | None] = mapped_column(SmallInteger)
    max_queued: Mapped[int | None] = mapped_column(Integer)  # MAX_QUEUED_PER_TENANT for this tenant
    rate_limit: Mapped[str | None] = mapped_column(String(200))  # RATE_LIMIT (per key) for this tenant's keys
    # tokens (prompt + completion; a live job counts its max_tokens) its jobs may use per period
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    budget_period_seconds: Mapped[int] = mapped_column(Integer, default=86400, server_default=text("86400"))
    updated_at: Mapped[datetime] = _timestamp(server_default=func.now(), onupdate=func.now())

    __table_args__ = (
        CheckConstraint("top_priority BETWEEN 0 AND 9", name="top_priority_range"),
        CheckConstraint("sync_priority BETWEEN 0 AND 9", name="sync_priority_range"),
        CheckConstraint("max_queued >= 0", name="max_queued_positive"),
        CheckConstraint("token_budget >= 0", name="token_budget_positive"),
        CheckConstraint("budget_period_seconds > 0", name="budget_period_positive"),
    )


class ApiKey(Base):
    """An API key; only its SHA-256 is stored (the key itself is random, 256 bits)."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the key's first characters, safe to show and log
    created_at: Mapped[datetime] = _timestamp(server_default=func.now())
    revoked_at: Mapped[datetime | None] = _timestamp()


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[JobStatus] = mapped_column(_status_enum(JobStatus, "status"), default=JobStatus.QUEUED)
    priority: Mapped[int] = mapped_column(SmallInteger)
    # the served name of the model it runs on (a worker of that model takes it); NULL: the fleet's default model
    # (rows written before jobs named their model)
    model: Mapped[str | None] = mapped_column(String(200))

    # the request, as validated by the API
    prompt: Mapped[str | None] = mapped_column(Utf8Text)
    input_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    max_tokens: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    stop: Mapped[list[str]] = mapped_column(ARRAY(Text), default=list)
    # the other sampling fields (contract/requests.py OPTIONS), those that differ from their defaults
    options: Mapped[dict] = mapped_column(JSONB, default=dict, server_default=text("'{}'::jsonb"))
    metadata_: Mapped[dict] = mapped_column("metadata", JSONB, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # the W3C traceparent of the API request that created it (tracing on): each worker's spans of the job are its
    # children, so a job is one trace from its request through every hold (contract/tracing.py); NULL: none
    traceparent: Mapped[str | None] = mapped_column(String(128))

    # the result, written by the worker (progress while running)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer), default=list)
    output_text: Mapped[str] = mapped_column(Utf8Text, default="")
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    logprobs: Mapped[dict | None] = mapped_column(JSONB)  # when the request asked for them
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    # the lease of the worker running it
    worker_id: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = _timestamp()
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # times a full worker handed it back for more urgent work (bounded, so a job is not preempted forever)
    handbacks: Mapped[int] = mapped_column(SmallInteger, default=0, server_default=text("0"))
    # what the columns keep no time of, in the order it happened (jobstore/job_events.py): re-claims, preemptions
    # inside the engine and resumes, hand-backs, lease expiries. NULL until the first; appended by the statements
    # that write the row anyway (claim, progress, result, hand-back, the reconciler's requeue)
    events: Mapped[list | None] = mapped_column(JSONB)

    # when its result is wanted (POST /jobs' `deadline`; a batch's jobs: the end of its completion window)
    deadline: Mapped[datetime | None] = _timestamp()

    # the batch this job is a line of (the Batch API), and the line's index in the batch's input file
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    batch_index: Mapped[int | None] = mapped_column(Integer)

    # timings
    created_at: Mapped[datetime] = _timestamp(server_default=func.now())
    enqueued_at: Mapped[datetime | None] = _timestamp()  # last sent to Redis
    started_at: Mapped[datetime | None] = _timestamp()
    first_token_at: Mapped[datetime | None] = _timestamp()
    finished_at: Mapped[datetime | None] = _timestamp()
    updated_at: Mapped[datetime] = _timestamp(server_default=func.now(), onupdate=func.now())

    __table_args__ = (
        CheckConstraint("priority BETWEEN 0 AND 9", name="priority_range"),
        CheckConstraint("max_tokens >= 1", name="max_tokens_positive"),
        CheckConstraint("(prompt IS NULL) <> (input_ids IS NULL)", name="prompt_xor_input_ids"),
        # GET /jobs: a tenant's jobs newest first, optionally by status (keyset pagination)
        Index("ix_jobs_tenant_created", "tenant_id", text("created_at DESC"), text("id DESC")),
        Index(
            "ix_jobs_tenant_status_created", "tenant_id", "status", text("created_at DESC"), text("id DESC")
        ),
        # Idempotency-Key: one job per (tenant, key)
        Index(
            "uq_jobs_tenant_idempotency_key",
            "tenant_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        # reconciler: expired leases (of the running jobs), and queued jobs never sent to Redis. Not keyed by
        # lease_expires_at, which every progress write renews: with no index on what it changes, and room on
        # the page (fillfactor, below), a progress write is a heap-only update (migration 0008)
        Index("ix_jobs_running_worker", "worker_id", postgresql_where=text("status = 'running'")),
        Index(
            "ix_jobs_queued_unsent",
            "created_at",
            postgresql_where=text("status = 'queued' AND enqueued_at IS NULL"),
        ),
        # reconciler: queued jobs sent before the messages still waiting in their priority's list (workers/unclaimed.py)
        Index(
            "ix_jobs_queued_sent",
            "priority",
            "enqueued_at",
            postgresql_where=text("status = 'queued' AND enqueued_at IS NOT NULL"),
        ),
        # POST /jobs: the queued-job caps count this (small) index, not the whole table; a batch's jobs
        # are not counted (a batch has limits of its own, and must not lock its tenant out of /jobs)
        Index(
            "ix_jobs_queued_tenant",
            "tenant_id",
            postgresql_where=text("status = 'queued' AND batch_id IS NULL"),
        ),
        # GET /jobs/ended: a tenant's jobs in the order they ended (set once, when the job ends)
        Index(
            "ix_jobs_tenant_finished",
            "tenant_id",
            "finished_at",
            "id",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        # the output-length history (jobstore/output_length.py): a tenant's succeeded jobs in the order they ended
        Index(
            "ix_jobs_tenant_succeeded",
            "tenant_id",
            "finished_at",
            "id",
            postgresql_where=text("status = 'succeeded'"),
        ),
        # a batch's jobs in input order: its request counts, its output file
        Index("ix_jobs_batch", "batch_id", "batch_index", postgresql_where=text("batch_id IS NOT NULL")),
        # /metrics: the live jobs past or near their deadline (a claim changes status anyway; a progress write
        # touches neither column, and stays a heap-only update)
        Index(
            "ix_jobs_live_deadline",
            "deadline",
            postgresql_where=text("deadline IS NOT NULL AND status IN ('queued', 'running')"),
        ),
        {"postgresql_with": {"fillfactor": 80}},  # room on each page for a running job's next row version
    )


class File(Base):
    """A file of the Batch API (an input of requests, or a batch's output or errors), in chunks."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "file-..." as OpenAI's ids look
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))  # "batch" (uploaded), "batch_output" (written)
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer)  # non-blank lines
    created_at: Mapped[datetime] = _timestamp(server_default=func.now())

    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", text("created_at DESC"), text("id DESC")),
    )


class FileChunk(Base):
    """One piece (about FILE_CHUNK_BYTES) of a file's content, so a file streams in and out in pieces."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """A batch of the Batch API: one job per line of its input file (jobs.batch_id)."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "batch_..."
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[BatchStatus] = mapped_column(_status_enum(BatchStatus, "status"))
    endpoint: Mapped[str] = mapped_column(String(32))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str] = mapped_column(String(40))  # kept when the file is deleted, as OpenAI does
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    priority: Mapped[int] = mapped_column(SmallInteger)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSONB)
    errors: Mapped[list | None] = mapped_column(JSONB)  # validation errors: [{code, message, param, line}]
    # the served models its valid requests run on, in the order the file first names them (migration 0016)
    models: Mapped[list[str] | None] = mapped_column(ARRAY(String(128)))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)  # written when it is finalized
    failed: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[datetime] = _timestamp(server_default=func.now())
    in_progress_at: Mapped[datetime | None] = _timestamp()
    expires_at: Mapped[datetime | None] = _timestamp()
    finalizing_at: Mapped[datetime | None] = _timestamp()
    completed_at: Mapped[datetime | None] = _timestamp()
    failed_at: Mapped[datetime | None] = _timestamp()
    expired_at: Mapped[datetime | None] = _timestamp()  # not done by expires_at: ended as `expired`
    cancelling_at: Mapped[datetime | None] = _timestamp()
    cancelled_at: Mapped[datetime | None] = _timestamp()

    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", text("created_at DESC"), text("id DESC")),
        # the reconciler's look for batches whose jobs are all done
        Index("ix_batches_live", "status", postgresql_where=text("status IN ('in_progress', 'cancelling')")),
    )
