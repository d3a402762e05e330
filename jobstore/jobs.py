"""Job state transitions, each one atomic SQL statement on the job row.

    create ─▶ queued ──claim──▶ running ──finish──▶ succeeded
                ▲                │  │ └───fail────▶ failed
                │                │  ├─(lease expired: requeue_expired)─▶ queued
                │                │  └─(worker shutting down: release_job)─▶ queued
                └─────cancel─────┴──────cancel────▶ cancelled

A worker changes a running job only while it holds the lease (`worker_id` matches); every write it
makes renews the lease. When a call returns False the job is no longer the worker's (cancelled, or
its lease expired and the job went back to the queue), and the worker must stop working on it.
The caller owns the transaction: these functions never commit. The worker runs them on an autocommit
connection (each one statement); the reconciler in a transaction.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy import Connection, Interval, bindparam, func, inspect, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobstore.models import Job, JobStatus

ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
JOBS = Job.__table__
_ATTRIBUTE = {attr.columns[0].key: attr.key for attr in inspect(Job).column_attrs}  # "metadata" -> "metadata_"
RECONCILER_LOCK = 0x67656E71  # pg advisory lock id ("genq") taken by the reconciler


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before by the same tenant with a different request."""


def request_fingerprint(request: Mapping) -> str:
    """A stable hash of a validated request body, to compare requests sharing an Idempotency-Key."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


def create_job(db: Session | Connection, tenant_id: uuid.UUID, request: Mapping, *, prompt_tokens: int | None = None,
               idempotency_key: str | None = None, max_queued: int | None = None) -> tuple[Job | None, bool]:
    """Insert a queued job from a validated request, in one statement; returns (job, created).

    - With `max_queued`, the job is inserted only while the tenant has fewer queued jobs; at the cap
      this returns (None, False). The count and the insert are one statement, so concurrent
      submissions of one tenant can overshoot the cap by at most their number.
    - With an `idempotency_key` this tenant used before, returns that job (created=False), or raises
      IdempotencyConflict when its request differed. A known key wins over the cap.

    `db` may be a Session or a Core Connection (the API uses an autocommit connection: no BEGIN, no
    COMMIT round trip). The returned Job is a plain object, attached to no session.
    """
    values = dict(request, tenant_id=tenant_id, status=JobStatus.QUEUED, prompt_tokens=prompt_tokens,
                  idempotency_key=idempotency_key,
                  request_hash=request_fingerprint(request) if idempotency_key else None)
    if max_queued is not None:
        values["max_queued"] = max_queued
    row = db.execute(_insert_job(tuple(values)), values).one_or_none()
    if row is not None:
        return _job_from_row(row), True
    existing = job_for_key(db, tenant_id, idempotency_key) if idempotency_key else None
    if existing is None:
        if max_queued is None:
            raise AssertionError("an insert without a cap or a key returned no row")
        return None, False  # the tenant is at its cap
    if existing.request_hash != values["request_hash"]:
        raise IdempotencyConflict(idempotency_key)
    return existing, False


@functools.lru_cache(maxsize=16)
def _insert_job(names: tuple[str, ...]):
    """The INSERT for a job with these column values (and "max_queued": the cap), built once per shape.

    Capped: INSERT INTO jobs (...) SELECT :values... WHERE (the tenant's queued jobs) < :max_queued.
    An Idempotency-Key already used inserts nothing (the partial unique index; NULL keys never clash).
    """
    columns = [name for name in names if name != "max_queued"]
    if "max_queued" in names:
        queued = (select(func.count()).select_from(JOBS)
                  .where(JOBS.c.tenant_id == bindparam("tenant_id"), JOBS.c.status == JobStatus.QUEUED)
                  .scalar_subquery())
        values = select(*[bindparam(name, type_=JOBS.c[name].type) for name in columns])
        stmt = insert(JOBS).from_select(columns, values.where(queued < bindparam("max_queued")))
    else:
        stmt = insert(JOBS).values({name: bindparam(name, type_=JOBS.c[name].type) for name in columns})
    return (stmt.on_conflict_do_nothing(index_elements=["tenant_id", "idempotency_key"],
                                        index_where=text("idempotency_key IS NOT NULL"))
            .returning(*JOBS.c))


def check_job_row(job: Job, max_model_len: int | None = None) -> None:
    """ValueError unless the stored request is one the API could have accepted (JobCreate, and token ids plus
    max_tokens within `max_model_len`; a text prompt's length is checked by the engine, which tokenizes it)."""
    from pydantic import ValidationError

    from jobstore.requests import JobCreate

    if job.prompt is not None:
        try:
            job.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("prompt: the stored bytes are not valid UTF-8") from None
    fields = {name: getattr(job, "metadata_" if name == "metadata" else name) for name in JobCreate.model_fields}
    fields["stop"] = list(fields["stop"] or [])
    if fields["input_ids"] is not None:
        fields["input_ids"] = list(fields["input_ids"])
    try:
        JobCreate.model_validate(fields)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors())) from None
    if not isinstance(job.output_token_ids, list) or len(job.output_token_ids) > job.max_tokens:
        raise ValueError("output_token_ids: more tokens than max_tokens")
    if max_model_len is not None and job.max_tokens + len(job.input_ids or ()) > max_model_len:
        raise ValueError(f"max_tokens: {len(job.input_ids or ())} prompt tokens + max_tokens {job.max_tokens} > "
                         f"max_model_len {max_model_len}")


def job_for_key(db: Session | Connection, tenant_id: uuid.UUID, idempotency_key: str) -> Job | None:
    """The tenant's job created with this Idempotency-Key, if any (a plain Job, attached to no session)."""
    row = db.execute(select(*JOBS.c).where(JOBS.c.tenant_id == tenant_id,
                                            JOBS.c.idempotency_key == idempotency_key)).one_or_none()
    return None if row is None else _job_from_row(row)


def get_job(db: Session | Connection, job_id: uuid.UUID, tenant_id: uuid.UUID | None = None) -> Job | None:
    """The job as stored now (a plain Job, attached to no session), or None when it does not exist or
    belongs to another tenant."""
    stmt = select(*JOBS.c).where(JOBS.c.id == job_id)
    if tenant_id is not None:
        stmt = stmt.where(JOBS.c.tenant_id == tenant_id)
    row = db.execute(stmt).one_or_none()
    return None if row is None else _job_from_row(row)


def list_jobs(session: Session, tenant_id: uuid.UUID, *, status: JobStatus | None = None, limit: int = 20,
              before: tuple[datetime, uuid.UUID] | None = None) -> list[Job]:
    """A tenant's jobs, newest first, starting after the (created_at, id) position `before`."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if before is not None:
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < tuple_(*before))
    return list(session.scalars(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))


def mark_enqueued(db: Session | Connection, job_ids: Sequence[uuid.UUID]) -> None:
    """Record that a message for these queued jobs went to Redis."""
    db.execute(update(JOBS).where(JOBS.c.id.in_(job_ids), JOBS.c.status == JobStatus.QUEUED)
               .values(enqueued_at=func.now()))


def claim_job(db: Session | Connection, job_id: uuid.UUID, worker_id: str, lease_seconds: float) -> Job | None:
    """queued → running for `worker_id` with a fresh lease; the job (a plain Job), or None if it is not queued."""
    row = db.execute(_claim_statement(), {"job": job_id, "worker": worker_id,
                                          "lease": timedelta(seconds=lease_seconds)}).one_or_none()
    return None if row is None else _job_from_row(row)


@functools.cache
def _claim_statement():
    """Built once: the claim is on every job's path from the queue to the engine."""
    return (update(JOBS).where(JOBS.c.id == bindparam("job"), JOBS.c.status == JobStatus.QUEUED)
            .values(status=JobStatus.RUNNING, worker_id=bindparam("worker"),
                    lease_expires_at=func.now() + bindparam("lease", type_=Interval()),
                    started_at=func.coalesce(JOBS.c.started_at, func.now()), attempts=JOBS.c.attempts + 1)
            .returning(*JOBS.c))


def renew_lease(db: Session | Connection, job_id: uuid.UUID, worker_id: str, lease_seconds: float) -> bool:
    """Extend the worker's lease; False if the job is no longer the worker's."""
    return _update_leased(db, job_id, worker_id, lease_expires_at=_lease(lease_seconds))


def save_progress(db: Session | Connection, job_id: uuid.UUID, worker_id: str, lease_seconds: float, *,
                  token_ids: Sequence[int], text: str, first_token_at: datetime | None = None) -> bool:
    """Store the tokens generated so far and renew the lease; False if the job is no longer the worker's."""
    return db.execute(_progress_statement(), {
        "job": job_id, "worker": worker_id, "lease": timedelta(seconds=lease_seconds), "tokens": list(token_ids),
        "text": text, "first": first_token_at}).rowcount == 1


def finish_job(db: Session | Connection, job_id: uuid.UUID, worker_id: str, *, token_ids: Sequence[int], text: str,
               finish_reason: str, prompt_tokens: int, first_token_at: datetime | None = None) -> bool:
    """running → succeeded with the full output; False if the job is no longer the worker's."""
    return db.execute(_finish_statement(), {
        "job": job_id, "worker": worker_id, "tokens": list(token_ids), "text": text, "reason": finish_reason,
        "prompt_count": prompt_tokens, "first": first_token_at}).rowcount == 1


def _leased(**values):
    """UPDATE of a running job leased by :worker (bind parameters :job, :worker)."""
    return (update(JOBS).where(JOBS.c.id == bindparam("job"), JOBS.c.status == JobStatus.RUNNING,
                               JOBS.c.worker_id == bindparam("worker")).values(**values))


@functools.cache
def _progress_statement():
    """Built once: every running job writes its progress every PROGRESS_INTERVAL."""
    return _leased(lease_expires_at=func.now() + bindparam("lease", type_=Interval()),
                   output_token_ids=bindparam("tokens", type_=JOBS.c.output_token_ids.type),
                   output_text=bindparam("text", type_=JOBS.c.output_text.type),
                   first_token_at=func.coalesce(JOBS.c.first_token_at,
                                                bindparam("first", type_=JOBS.c.first_token_at.type)))


@functools.cache
def _finish_statement():
    """Built once: every job ends with it."""
    return _leased(status=JobStatus.SUCCEEDED, finished_at=func.now(), lease_expires_at=None,
                   output_token_ids=bindparam("tokens", type_=JOBS.c.output_token_ids.type),
                   output_text=bindparam("text", type_=JOBS.c.output_text.type),
                   finish_reason=bindparam("reason", type_=JOBS.c.finish_reason.type),
                   prompt_tokens=bindparam("prompt_count", type_=JOBS.c.prompt_tokens.type),
                   first_token_at=func.coalesce(JOBS.c.first_token_at,
                                                bindparam("first", type_=JOBS.c.first_token_at.type)))


def fail_job(db: Session | Connection, job_id: uuid.UUID, worker_id: str, *, code: str, message: str) -> bool:
    """running → failed with an error; False if the job is no longer the worker's."""
    return _update_leased(db, job_id, worker_id, status=JobStatus.FAILED, finished_at=func.now(),
                          lease_expires_at=None, error_code=code, error_message=message)


def cancel_job(db: Session | Connection, job_id: uuid.UUID, tenant_id: uuid.UUID) -> Job | None:
    """queued/running → cancelled; returns the job as it now is (any status), None if not the tenant's."""
    row = db.execute(
        update(JOBS).where(JOBS.c.id == job_id, JOBS.c.tenant_id == tenant_id, JOBS.c.status.in_(ACTIVE))
        .values(status=JobStatus.CANCELLED, finished_at=func.now(), lease_expires_at=None,
                finish_reason=func.coalesce(JOBS.c.finish_reason, "abort"))
        .returning(*JOBS.c)
    ).one_or_none()
    return _job_from_row(row) if row is not None else get_job(db, job_id, tenant_id)


def release_job(db: Session | Connection, job_id: uuid.UUID, worker_id: str, *, token_ids: Sequence[int],
                text: str) -> bool:
    """running → queued, keeping the tokens so far and dropping the lease, so that another worker resumes
    the job at once (a worker shutting down hands its jobs back). False if the job is no longer the worker's."""
    return _update_leased(db, job_id, worker_id, status=JobStatus.QUEUED, worker_id=None,
                          lease_expires_at=None, enqueued_at=None, output_token_ids=list(token_ids),
                          output_text=text)


def forget_sent(session: Session, sent_before_seconds: float = 0.0) -> int:
    """Mark queued jobs sent to Redis more than `sent_before_seconds` ago as never sent, so the reconciler
    sends them again (Redis lost its data, or the message went missing); returns how many."""
    result = session.execute(
        update(Job).where(Job.status == JobStatus.QUEUED, Job.enqueued_at.is_not(None),
                          Job.enqueued_at <= func.now() - timedelta(seconds=sent_before_seconds))
        .values(enqueued_at=None).execution_options(synchronize_session=False))
    return result.rowcount


def requeue_expired(session: Session) -> list[tuple[uuid.UUID, int]]:
    """running → queued for jobs whose lease expired (their worker died); they keep their tokens.

    Returns their (id, priority), to be sent to Redis again at once."""
    rows = session.execute(
        update(Job).where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < func.now())
        .values(status=JobStatus.QUEUED, worker_id=None, lease_expires_at=None, enqueued_at=None)
        .returning(Job.id, Job.priority)
    )
    return [(row.id, row.priority) for row in rows]


def unsent_jobs(session: Session, grace_seconds: float, limit: int = 1000) -> list[tuple[uuid.UUID, int]]:
    """(id, priority) of queued jobs never sent to Redis, committed more than `grace_seconds` ago."""
    rows = session.execute(
        select(Job.id, Job.priority)
        .where(Job.status == JobStatus.QUEUED, Job.enqueued_at.is_(None),
               Job.created_at < func.now() - timedelta(seconds=grace_seconds))
        .order_by(Job.priority, Job.created_at).limit(limit)
    )
    return [(row.id, row.priority) for row in rows]


def try_reconciler_lock(session: Session) -> bool:
    """Take the reconciler's transaction-scoped lock; False if another reconciler holds it."""
    return session.scalar(select(func.pg_try_advisory_xact_lock(RECONCILER_LOCK)))


def queued_by_tenant(db: Session | Connection) -> dict[uuid.UUID, int]:
    """Queued jobs per tenant (tenants with none are left out)."""
    return dict(db.execute(select(JOBS.c.tenant_id, func.count()).where(JOBS.c.status == JobStatus.QUEUED)
                           .group_by(JOBS.c.tenant_id)).all())


def _job_from_row(row) -> Job:
    """A Job (transient, in no session) from a row of all the jobs table's columns."""
    return Job(**{_ATTRIBUTE.get(key, key): value for key, value in row._mapping.items()})


def _lease(lease_seconds: float):
    return func.now() + timedelta(seconds=lease_seconds)


def _update_leased(db: Session | Connection, job_id: uuid.UUID, worker_id: str, /, **values) -> bool:
    """Apply `values` to a running job leased by `worker_id`; True if it was."""
    return db.execute(_leased(**values), {"job": job_id, "worker": worker_id}).rowcount == 1
