"""Batches of the Batch API in Postgres: the batch row, its jobs inserted in bulk, its request counts,
cancelling it, and finalizing it (writing the output and error files once every job has ended).

    POST /v1/batches ──▶ in_progress (jobs queued) ──all jobs ended──▶ completed
          │                     ├──cancel──▶ cancelling ──all jobs ended──▶ cancelled
          │                     └──expires_at passed──▶ expired (its unfinished jobs cancelled)
          └─(a line is invalid: nothing queued)──▶ failed

A line naming a model the fleet does not serve fails alone, as OpenAI's error file reports a request its endpoint
answered with an error: its job is written `failed` (code `model_not_found`, never queued), and the rest of the
file runs.

Finalizing runs where it is durable and prompt: the reconciler (celery beat, every RECONCILE_INTERVAL)
finalizes every batch whose jobs have all ended, and GET /v1/batches/<id> finalizes the batch it reads
when it finds it ready, so a client polling sees `completed` at once. Both run `finalize_batch`, one
transaction that locks the batch row (SKIP LOCKED: a second finalizer passes by): it is written whole or
not at all, and a process dying half way leaves the batch ready for the next try.

Expiry (OpenAI's rule): a batch still in progress at its expires_at (created + its completion window,
BATCH_WINDOW_SECONDS for "24h") is ended by the reconciler with `expire_batch`, one transaction: its queued
and running jobs are cancelled with error code `batch_expired` (a queued one's message is dropped by the
worker that takes it; a running one leaves its worker's batch at the next progress write), the requests
that finished go to the output file, the others to the error file, and the batch becomes `expired`.
A batch may mix models: each job names its own (the `model` column), and its output line names that model and
names its tokens with that model's tokenizer (`ModelOf`, given by the caller, which knows the fleet).
The caller owns the transaction: nothing here commits.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import exists, func, select, tuple_, update
from sqlalchemy.orm import Session

from contract.requests import options_of
from jobstore.batch_output import output_line
from jobstore.files import FileWriter
from jobstore.jobs import ACTIVE
from jobstore.models import Batch, BatchStatus, Job, JobStatus

LIVE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
# the columns a batch's jobs are COPYed with, in this order (the rest take their defaults)
JOB_COLUMNS = (
    "id",
    "tenant_id",
    "status",
    "priority",
    "prompt",
    "input_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "options",
    "metadata",
    "prompt_tokens",
    "output_token_ids",
    "output_text",
    "attempts",
    "handbacks",
    "deadline",
    "batch_id",
    "batch_index",
    "enqueued_at",
    "model",
    "traceparent",
    "error_code",  # the last three are set only on a refused line's job (job_row's `refusal`)
    "error_message",
    "finished_at",
)
EXPIRED_CODE = "batch_expired"
EXPIRED_MESSAGE = "this request could not be executed before the batch's completion window expired"
EMPTY_ARRAY = "{}"  # an empty array in COPY's text form
PAGE = 1000  # jobs read at once while writing the output file
# a job's `model` column (None: a row from before jobs named their model) -> (the name its output line gives, the
# tokenizer that names its tokens, or None: "token_id:<id>")
ModelOf = Callable[[str | None], tuple[str, Any]]


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def job_row(
    tenant_id: uuid.UUID,
    batch_id: str,
    index: int,
    request: dict,
    prompt_tokens: int,
    sent_at: datetime,
    traceparent: str | None = None,
    refusal: tuple[str, str] | None = None,
) -> tuple[uuid.UUID, tuple]:
    """(the new job's id, its row in JOB_COLUMNS order) for a validated request (JobCreate's fields).
    `traceparent`: the W3C traceparent of the request creating the batch (None: untraced), so that each
    worker's spans of the job join that request's trace, as a POST /jobs job's do.

    The row says it was sent at `sent_at` (enqueued_at): the batch's jobs are sent right after their
    commit, and marking 10,000 rows sent afterwards cost a tenth of a batch's submission. If the send
    fails, `mark_unsent` clears the mark and the reconciler sends them; if the API process dies between
    commit and send, the reconciler sends them again RESEND_AFTER_SECONDS after `sent_at`.

    `refusal` ((error code, message)): the line cannot run (it names a model the fleet does not serve); its job
    is written failed, ended at `sent_at`, never sent, and its error file line says why."""
    job_id = uuid.uuid4()
    prompt = request.get("prompt")
    return job_id, (
        job_id,
        tenant_id,
        JobStatus.QUEUED.value if refusal is None else JobStatus.FAILED.value,
        request["priority"],
        None if prompt is None else prompt.encode("utf-8"),
        _int_array(request.get("input_ids")),
        request["max_tokens"],
        request["temperature"],
        request["top_p"],
        request["top_k"],
        request["seed"],
        list(request["stop"]) or EMPTY_ARRAY,
        Jsonb(options_of(request)),
        Jsonb(request["metadata"]),
        prompt_tokens,
        EMPTY_ARRAY,
        b"",
        0,
        0,
        request.get("deadline"),  # the end of the batch's completion window (webapi/batches.py)
        batch_id,
        index,
        sent_at if refusal is None else None,
        request.get("model"),  # the served model its line names (webapi/batch_lines.py), or the refused name
        traceparent,
        *((None, None, None) if refusal is None else (*refusal, sent_at)),
    )


def _int_array(values: list[int] | None) -> str | None:
    """An integer array in Postgres's text form, "{1, 2, 3}" (spaces are allowed between elements): psycopg's
    list dumper costs ~40 us a row in Python, and a list's own repr half what joining its items does."""
    return None if values is None else "{" + repr(values)[1:-1] + "}"


@contextmanager
def copy_jobs(session: Session) -> Iterator[Callable[[Iterable[tuple]], None]]:
    """One COPY into jobs, open for the block: it yields `write(rows)` (values in JOB_COLUMNS order), to call
    as rows are ready. Postgres's fastest way in; and kept open across a batch's groups of lines, the server
    inserts one group while the API prepares the next (on two cores, in parallel), where a COPY per group
    waited for each. The session's connection is busy until the block ends: read with another one."""
    raw = session.connection().connection.driver_connection
    with raw.cursor() as cursor, cursor.copy(f"COPY jobs ({', '.join(JOB_COLUMNS)}) FROM STDIN") as copy:

        def write(rows: Iterable[tuple]) -> None:
            for row in rows:
                copy.write_row(row)

        yield write


def get_batch(db: Session, batch_id: str, tenant_id: uuid.UUID) -> Batch | None:
    """The tenant's batch, or None (another tenant's batch is indistinguishable from a missing one)."""
    return db.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))


def list_batches(db: Session, tenant_id: uuid.UUID, *, after: str | None, limit: int) -> list[Batch]:
    """The tenant's batches, newest first, starting after the batch `after` (none: from the newest)."""
    stmt = select(Batch).where(Batch.tenant_id == tenant_id)
    if after is not None:
        anchor = select(Batch.created_at, Batch.id).where(Batch.id == after, Batch.tenant_id == tenant_id)
        position = db.execute(anchor).one_or_none()
        if position is None:
            return []
        stmt = stmt.where(tuple_(Batch.created_at, Batch.id) < tuple_(*position))
    return list(db.scalars(stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)))


def request_counts(db: Session, batch: Batch) -> tuple[int, int, int]:
    """(total, completed, failed) requests: stored once the batch is finalized, else counted from its jobs
    (a cancelled request counts as failed, as its line goes to the error file)."""
    if batch.status not in LIVE:
        return batch.total, batch.completed, batch.failed
    counts = dict(
        db.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch.id).group_by(Job.status)
        ).all()
    )
    completed = counts.get(JobStatus.SUCCEEDED, 0)
    failed = counts.get(JobStatus.FAILED, 0) + counts.get(JobStatus.CANCELLED, 0)
    return batch.total, completed, failed


def cancel_batch(db: Session, batch: Batch) -> int:
    """in_progress → cancelling, and every queued or running job of the batch cancelled (a running one
    leaves its worker's batch within a progress interval); returns how many jobs were cancelled.
    Finalizing then makes the batch `cancelled`."""
    if batch.status != BatchStatus.IN_PROGRESS:
        return 0
    batch.status, batch.cancelling_at = BatchStatus.CANCELLING, func.now()
    cancelled = _cancel_jobs(db, batch.id)
    db.flush()
    return cancelled


def _cancel_jobs(db: Session, batch_id: str, **error) -> int:
    """Cancel the batch's queued and running jobs (with an error code and message, if given); how many."""
    return db.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status.in_(ACTIVE))
        .values(
            status=JobStatus.CANCELLED,
            finished_at=func.now(),
            lease_expires_at=None,
            finish_reason=func.coalesce(Job.finish_reason, "abort"),
            **error,
        )
        .execution_options(synchronize_session=False)
    ).rowcount


def expiring_batches(db: Session, limit: int = 100) -> list[str]:
    """Ids of batches still in progress past their expires_at: to expire."""
    return list(
        db.scalars(
            select(Batch.id)
            .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.expires_at <= func.now())
            .limit(limit)
        )
    )


def expire_batch(db: Session, batch_id: str, models: ModelOf) -> int | None:
    """in_progress past expires_at → expired: its unfinished jobs cancelled (code `batch_expired`), its
    output and error files written; returns how many jobs were cancelled, None if the batch is not due
    (not in progress, not past its expires_at, or another process holds it)."""
    batch = db.scalar(
        select(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.IN_PROGRESS, Batch.expires_at <= func.now())
        .with_for_update(skip_locked=True)
    )
    if batch is None:
        return None
    cancelled = _cancel_jobs(db, batch_id, error_code=EXPIRED_CODE, error_message=EXPIRED_MESSAGE)
    batch.finalizing_at = func.now()
    _write_results(db, batch, models)
    batch.status, batch.expired_at = BatchStatus.EXPIRED, func.now()
    db.flush()
    return cancelled


def ready_batches(db: Session, limit: int = 100) -> list[str]:
    """Ids of live batches whose jobs have all ended: ready to finalize."""
    active = exists().where(Job.batch_id == Batch.id, Job.status.in_(ACTIVE))
    return list(db.scalars(select(Batch.id).where(Batch.status.in_(LIVE), ~active).limit(limit)))


def finalize_batch(db: Session, batch_id: str, models: ModelOf) -> bool:
    """Write the output file (one line per succeeded request) and the error file (one per failed or
    cancelled request), in input order, and end the batch; False if it is not ready or another process is
    finalizing it. Holds one page of jobs and one file chunk in memory at a time."""
    batch = db.scalar(
        select(Batch).where(Batch.id == batch_id, Batch.status.in_(LIVE)).with_for_update(skip_locked=True)
    )
    if batch is None or db.scalar(select(exists().where(Job.batch_id == batch_id, Job.status.in_(ACTIVE)))):
        return False
    batch.finalizing_at = func.now()
    cancelled = batch.status == BatchStatus.CANCELLING
    _write_results(db, batch, models, batch_cancelled=cancelled)
    batch.status = BatchStatus.CANCELLED if cancelled else BatchStatus.COMPLETED
    if cancelled:
        batch.cancelled_at = func.now()
    else:
        batch.completed_at = func.now()
    db.flush()
    return True


def _write_results(db: Session, batch: Batch, models: ModelOf, batch_cancelled: bool = False) -> None:
    """Write the batch's output file (its succeeded requests) and error file (the rest), in input order,
    and its request counts; every job of the batch has ended."""
    files: dict[bool, FileWriter] = {}
    completed = failed = 0
    seen: dict[str | None, tuple[str, Any]] = {}  # each model looked up once a batch
    for row in _batch_jobs(db, batch.id):
        if row.model not in seen:
            seen[row.model] = models(row.model)
        model, tokenizer = seen[row.model]
        succeeded = row.status == JobStatus.SUCCEEDED
        completed, failed = completed + succeeded, failed + (not succeeded)
        if succeeded not in files:
            name = f"{batch.id}_{'output' if succeeded else 'error'}.jsonl"
            files[succeeded] = FileWriter(db, batch.tenant_id, "batch_output", name)
        line = output_line(row, batch.endpoint, model, batch_cancelled=batch_cancelled, tokenizer=tokenizer)
        files[succeeded].write(json.dumps(line).encode() + b"\n")  # ASCII: any text survives
    for writer in files.values():
        writer.close()
    batch.completed, batch.failed = completed, failed
    batch.output_file_id = files[True].file.id if True in files else None
    batch.error_file_id = files[False].file.id if False in files else None


def _batch_jobs(db: Session, batch_id: str):
    """The batch's jobs in input order, a page at a time (keyset on batch_index)."""
    columns = (
        Job.id,
        Job.status,
        Job.batch_index,
        Job.metadata_,
        Job.output_text,
        func.cardinality(Job.output_token_ids).label("completion_tokens"),
        Job.prompt_tokens,
        Job.finish_reason,
        Job.error_code,
        Job.error_message,
        Job.finished_at,
        Job.options,
        Job.logprobs,
        Job.prompt,
        Job.input_ids,
        Job.model,
    )
    last = -1
    while True:
        page = db.execute(
            select(*columns)
            .where(Job.batch_id == batch_id, Job.batch_index > last)
            .order_by(Job.batch_index)
            .limit(PAGE)
        ).all()
        yield from page
        if len(page) < PAGE:
            return
        last = page[-1].batch_index


def mark_unsent(db: Session, batch_id: str) -> int:
    """Record that the batch's queued jobs did not reach Redis: the reconciler sends them."""
    return db.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
        .values(enqueued_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount


def job_ids(db: Session, batch_id: str) -> Sequence[tuple[uuid.UUID, int]]:
    """(id, priority) of the batch's queued jobs, in input order."""
    return db.execute(
        select(Job.id, Job.priority)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
        .order_by(Job.batch_index)
    ).all()
