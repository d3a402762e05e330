"""Database tables: tenants, their API keys (hashed), and jobs."""

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


def _timestamp(**kwargs) -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), **kwargs)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = _timestamp(server_default=func.now())


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
    status: Mapped[JobStatus] = mapped_column(
        Enum(
            JobStatus,
            name="status",
            native_enum=False,
            length=16,
            create_constraint=True,
            values_callable=lambda e: [m.value for m in e],
        ),
        default=JobStatus.QUEUED,
    )
    priority: Mapped[int] = mapped_column(SmallInteger)

    # the request, as validated by the API
    prompt: Mapped[str | None] = mapped_column(Utf8Text)
    input_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    max_tokens: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    stop: Mapped[list[str]] = mapped_column(ARRAY(Text), default=list)
    metadata_: Mapped[dict] = mapped_column("metadata", JSONB, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))

    # the result, written by the worker (progress while running)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer), default=list)
    output_text: Mapped[str] = mapped_column(Utf8Text, default="")
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    # the lease of the worker running it
    worker_id: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = _timestamp()
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # times a full worker handed it back for more urgent work (bounded, so a job is not preempted forever)
    handbacks: Mapped[int] = mapped_column(SmallInteger, default=0, server_default=text("0"))

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
        # reconciler: expired leases, and queued jobs never sent to Redis
        Index("ix_jobs_running_lease", "lease_expires_at", postgresql_where=text("status = 'running'")),
        Index(
            "ix_jobs_queued_unsent",
            "created_at",
            postgresql_where=text("status = 'queued' AND enqueued_at IS NULL"),
        ),
        # POST /jobs: the queued-job caps count this (small) index, not the whole table
        Index("ix_jobs_queued_tenant", "tenant_id", postgresql_where=text("status = 'queued'")),
    )
