"""Many jobs of one tenant inserted in one statement (POST /jobs/bulk), with POST /jobs' rules per item:
an Idempotency-Key used before answers its job (or a conflict when the body differs), and the tenant's
queued-job cap admits only as many new jobs as it has room for.

One transaction: the tenant's advisory lock (the one POST /jobs takes near its cap, so the two paths count
one after the other), the tenant's queued count, the known keys in one SELECT, then the new jobs' INSERT
(one statement, compiled once, sent with many rows a round trip), ON CONFLICT DO NOTHING on the key (a key inserted meanwhile by a racing call is then read
back, as create_job does). The caller owns the transaction.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, func, select, text
from sqlalchemy.dialects.postgresql import insert

from contract.requests import job_columns
from jobstore.jobs import JOBS, TENANT_CAP_LOCKS, _job_from_row, request_fingerprint
from jobstore.models import Job, JobStatus


class Outcome(str, enum.Enum):
    CREATED = "created"  # a new job, to send to Redis
    EXISTING = "existing"  # the job its Idempotency-Key made before, same body
    KEY_CONFLICT = "key_conflict"  # the key was used before with another body
    AT_CAP = "at_cap"  # the tenant's queued-job cap left no room for it


@dataclass(frozen=True, slots=True)
class BulkItem:
    request: Mapping  # a validated request (JobCreate's fields)
    prompt_tokens: int
    idempotency_key: str | None = None


@dataclass(frozen=True, slots=True)
class BulkResult:
    outcome: Outcome
    job: Job | None = None


def create_jobs(
    conn: Connection,
    tenant_id: uuid.UUID,
    items: Sequence[BulkItem],
    *,
    max_queued: int,
    traceparent: str | None = None,
) -> tuple[list[BulkResult], int]:
    """Insert the items' jobs (one result per item, in order) and return them with the tenant's queued
    jobs after the insert. Items beyond the cap's room are AT_CAP; a key given twice in `items` makes
    one job, the second item answered as its retry would be. `traceparent`: the request's (create_job's),
    on each of its jobs."""
    tenant_key = int.from_bytes(tenant_id.bytes[:4], "big", signed=True)
    conn.execute(select(func.pg_advisory_xact_lock(TENANT_CAP_LOCKS, tenant_key)))
    queued = conn.scalar(
        select(func.count())
        .select_from(JOBS)
        .where(JOBS.c.tenant_id == tenant_id, JOBS.c.status == JobStatus.QUEUED, JOBS.c.batch_id.is_(None))
    )
    keys = {item.idempotency_key for item in items if item.idempotency_key is not None}
    known = _jobs_for_keys(conn, tenant_id, keys)
    room = max(0, max_queued - queued)
    results: list[BulkResult | None] = [None] * len(items)
    rows, first_for_key = [], {}
    for index, item in enumerate(items):
        key = item.idempotency_key
        fingerprint = request_fingerprint(item.request) if key is not None else None
        if key in known:
            same = known[key].request_hash == fingerprint
            results[index] = BulkResult(
                Outcome.EXISTING if same else Outcome.KEY_CONFLICT, known[key] if same else None
            )
        elif key is not None and key in first_for_key:
            continue  # answered once the first item with this key is
        elif len(rows) >= room:
            results[index] = BulkResult(Outcome.AT_CAP)
        else:
            if key is not None:
                first_for_key[key] = (index, fingerprint)
            rows.append(
                dict(
                    job_columns(item.request),
                    id=uuid.uuid4(),
                    tenant_id=tenant_id,
                    status=JobStatus.QUEUED,
                    prompt_tokens=item.prompt_tokens,
                    idempotency_key=key,
                    request_hash=fingerprint,
                    traceparent=traceparent,
                )
            )
            results[index] = BulkResult(Outcome.CREATED)  # its job filled in below
    inserted = {}
    if (
        rows
    ):  # executemany: one statement compiled once (cached), sent as multi-row INSERTs ("insertmanyvalues")
        inserted = {row.id: _job_from_row(row) for row in conn.execute(_INSERT_JOBS, rows)}
    raced = {row["idempotency_key"] for row in rows if row["id"] not in inserted}
    known.update(_jobs_for_keys(conn, tenant_id, raced))
    row_of = iter(rows)
    for index, result in enumerate(list(results)):
        if result is not None and result.outcome is Outcome.CREATED:
            row = next(row_of)
            job = inserted.get(row["id"])
            if job is None:  # a racing call inserted its key first
                other = known[row["idempotency_key"]]
                same = other.request_hash == row["request_hash"]
                results[index] = BulkResult(
                    Outcome.EXISTING if same else Outcome.KEY_CONFLICT, other if same else None
                )
            else:
                results[index] = BulkResult(Outcome.CREATED, job)
    for index, item in enumerate(items):
        if results[index] is None:  # a repeat, in this call, of an earlier item's key
            first, fingerprint = first_for_key[item.idempotency_key]
            job = results[first].job
            same = job is not None and request_fingerprint(item.request) == fingerprint
            results[index] = BulkResult(
                Outcome.EXISTING if same else Outcome.KEY_CONFLICT, job if same else None
            )
    return results, queued + len(inserted)


_INSERT_JOBS = (
    insert(JOBS)
    .on_conflict_do_nothing(
        index_elements=["tenant_id", "idempotency_key"], index_where=text("idempotency_key IS NOT NULL")
    )
    .returning(*JOBS.c)
)


def _jobs_for_keys(conn: Connection, tenant_id: uuid.UUID, keys: set[str]) -> dict[str, Job]:
    if not keys:
        return {}
    rows = conn.execute(
        select(*JOBS.c).where(JOBS.c.tenant_id == tenant_id, JOBS.c.idempotency_key.in_(sorted(keys)))
    )
    return {row.idempotency_key: _job_from_row(row) for row in rows}
