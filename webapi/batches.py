"""/v1/batches: OpenAI's Batch API over genq jobs. Creating a batch validates its whole input file and,
when every line is valid, inserts one job per line (COPY) and sends them to Redis in pipelines; a file
with an invalid line makes a `failed` batch with per-line errors, and nothing of it is queued. A batch's
jobs run at BATCH_PRIORITY (8) unless `metadata.priority` ("0" … "9") says otherwise. The output file
is written once every job has ended (jobstore/batches.py: by the reconciler, or here when polled). A batch
not done by its expires_at (its completion_window, "24h": BATCH_WINDOW_SECONDS) is ended `expired` by the
reconciler: its unfinished requests go to the error file with code `batch_expired`. Each job of a batch has that
expires_at as its deadline: within its priority, the engine runs first the jobs whose window is about to close.
A file may mix models (webapi/batch_lines.py): each job goes to its own model's queue, and its output line names
its model; a line naming a model the fleet does not serve fails alone (404 model_not_found in the error file). The
batch's `model` is the model its runnable requests run on, or null when they run on several."""

from __future__ import annotations

import itertools
import logging
from datetime import datetime, timedelta, timezone

from flask import Blueprint
from kombu.exceptions import KombuError
from redis.exceptions import RedisError
from sqlalchemy import func

from contract.dispatch import model_queue
from contract.tracing import current_traceparent
from jobstore import batches
from jobstore.files import iter_chunks, iter_lines
from jobstore.models import Batch, BatchStatus
from webapi.auth import current_tenant, require_api_key
from webapi.batch_lines import BatchBuilder
from webapi.errors import APIError
from webapi.extensions import db, services
from webapi.files import OBJECT_ID, owned_file
from webapi.fleet import ModelNotServed
from webapi.gc_pause import gc_paused
from webapi.metrics import JOBS_CANCELLED, JOBS_SUBMITTED
from webapi.openai_schemas import BatchCreate, BatchListQuery, BatchObject, BatchPage, RequestCounts
from webapi.prompts import NoChatTemplate, tokenizer_for
from webapi.spec import endpoint, model_vocabulary
from webapi.tenant_limits import check_priority, tenant_policy, token_budget

log = logging.getLogger(__name__)
bp = Blueprint("batches", __name__, url_prefix="/v1/batches")
bp.before_request(require_api_key)
LINES_PER_GROUP = 1000  # lines validated, rendered and COPYed at once


@bp.post("")
@endpoint(body=BatchCreate, responses={200: BatchObject}, errors=(403,))
@gc_paused()  # a 10,000-line batch builds ~10^6 objects: webapi/gc_pause.py
def create_batch(body: BatchCreate):
    """Create a batch from an uploaded file; it is validated whole, then its requests are queued."""
    settings = services().settings
    file = owned_file(body.input_file_id)
    if file.purpose != "batch":
        raise APIError(400, "invalid_request", f"input_file_id: {file.id} is not a batch input file")
    if file.lines > settings.max_batch_requests:
        raise APIError(
            400,
            "too_many_batch_requests",
            f"input_file_id: {file.lines:,} requests, more than the {settings.max_batch_requests:,} a batch may hold",
        )
    policy = tenant_policy()
    if "priority" in (body.metadata or {}):
        priority = int(body.metadata["priority"])
        check_priority(priority, "metadata.priority")
    else:  # BATCH_PRIORITY, or the tenant's top_priority if that is less urgent
        priority = max(settings.batch_priority, policy.top_priority)
    token_budget().spend(1)  # a tenant at its budget starts no batch (its lines are not counted ahead)
    # the completion window's end: the batch expires then, and its jobs have it as their deadline
    expires_at = datetime.now(timezone.utc) + timedelta(seconds=settings.batch_window_seconds)
    with services().sessions.begin() as session:
        batch = Batch(
            id=batches.new_batch_id(),
            tenant_id=current_tenant().id,
            status=BatchStatus.VALIDATING,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            input_file_id=file.id,
            priority=priority,
            metadata_=body.metadata,
            total=0,
            completed=0,
            failed=0,
        )
        session.add(batch)
        session.flush()
        builder = validate_and_insert(session, batch, file.id, expires_at)
        batch.models = builder.models
        if builder.error_count or not builder.requests:
            batch.status, batch.failed_at = BatchStatus.FAILED, func.now()
            batch.errors = [e.as_dict() for e in builder.errors] or [
                {
                    "code": "empty_file",
                    "message": "input_file_id: the file holds no request",
                    "param": None,
                    "line": None,
                }
            ]
        else:
            batch.status, batch.in_progress_at, batch.total = (
                BatchStatus.IN_PROGRESS,
                func.now(),
                builder.requests,
            )
            batch.expires_at = expires_at
        session.flush()
        session.refresh(batch)  # the timestamps Postgres set
    if batch.status == BatchStatus.IN_PROGRESS:
        send(batch, builder)
    log.info(
        "batch %s of tenant %s: %s, %d requests at priority %d (%d naming no served model)",
        batch.id,
        current_tenant().name,
        batch.status.value,
        builder.requests,
        priority,
        builder.refused,
    )
    return batch_object(batch)


def validate_and_insert(session, batch: Batch, file_id: str, deadline: datetime) -> BatchBuilder:
    """Validate every line of the file; insert its jobs, each with `deadline` (in a savepoint, undone if any
    line is invalid)."""
    fleet = services().fleet
    builder = BatchBuilder(
        batch.id,
        batch.tenant_id,
        batch.endpoint,
        batch.priority,
        fleet.resolve,  # each line's model: the one its body names, the fleet's default if none
        model_vocabulary,
        deadline,
        current_traceparent(),  # TRACING: each job joins this request's trace, as POST /jobs' jobs do
    )
    savepoint = session.begin_nested()
    try:  # the file is read on a connection of its own: the session's carries the COPY
        with services().sessions() as reader, batches.copy_jobs(session) as write:
            lines = iter_lines(iter_chunks(reader, file_id))
            while group := list(itertools.islice(lines, LINES_PER_GROUP)):
                rows = builder.add(group)
                if not builder.error_count:  # after an invalid line, the rest is only validated
                    write(rows)
    except NoChatTemplate as exc:
        savepoint.rollback()
        raise APIError(400, "invalid_request", f"endpoint: {exc}") from None
    if builder.error_count or not builder.requests:
        savepoint.rollback()
    else:
        savepoint.commit()
    return builder


def send(batch: Batch, builder: BatchBuilder) -> None:
    """Send the batch's committed jobs to Redis in pipelines (their rows already say sent); if Redis is
    down, clear that mark so the reconciler sends them (they are in Postgres)."""
    by_queue: dict[str, list] = {}  # each model's jobs to its own queue, in input order
    for job_id, model in zip(builder.job_ids, builder.job_models, strict=True):
        by_queue.setdefault(model_queue(services().settings, model), []).append(job_id)
    try:
        sent = sum(
            services().bulk_sender.send(((job_id, batch.priority) for job_id in ids), queue)
            for queue, ids in by_queue.items()
        )
    except (KombuError, RedisError, OSError) as exc:
        log.warning("batch %s stays queued unsent (the reconciler will send it): %s", batch.id, exc)
        with services().sessions.begin() as session:
            batches.mark_unsent(session, batch.id)
        return
    JOBS_SUBMITTED.labels(priority=str(batch.priority)).inc(sent)


@bp.get("/<batch_id>")
@endpoint(responses={200: BatchObject})
def get_batch(batch_id: str):
    """A batch: its status and request counts; a batch whose jobs have all ended is finalized here."""
    batch = owned_batch(batch_id)
    if batch.status in batches.LIVE:
        with services().sessions.begin() as session:
            finalized = batches.finalize_batch(session, batch.id, output_model)
        if finalized:
            db().expire_all()
            batch = owned_batch(batch_id)
    return batch_object(batch)


@bp.get("")
@endpoint(query=BatchListQuery, responses={200: BatchPage})
def list_batches(query: BatchListQuery):
    """The caller's batches, newest first, a page at a time (`after`: the last id of the previous page)."""
    if query.after is not None and not OBJECT_ID.fullmatch(query.after):
        raise APIError(422, "invalid_request", "after: not a batch id")
    page = batches.list_batches(db(), current_tenant().id, after=query.after, limit=query.limit + 1)
    return BatchPage.of(page, query.limit, lambda b: BatchObject.model_validate(batch_object(b))).model_dump()


@bp.post("/<batch_id>/cancel")
@endpoint(responses={200: BatchObject}, errors=(409,))
def cancel_batch(batch_id: str):
    """Cancel a batch: its queued and running requests are cancelled; it is `cancelled` once finalized."""
    batch = owned_batch(batch_id)
    if batch.status not in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        raise APIError(409, "conflict", f"batch already {batch.status.value}; it cannot be cancelled")
    with services().sessions.begin() as session:
        cancelled = batches.cancel_batch(session, session.get(Batch, batch.id, with_for_update=True))
    if cancelled:
        JOBS_CANCELLED.labels(str(batch.priority)).inc(cancelled)
        log.info(
            "batch %s cancelled by tenant %s: %d jobs cancelled", batch.id, current_tenant().name, cancelled
        )
    db().expire_all()
    return batch_object(owned_batch(batch_id))


def output_model(name: str | None) -> tuple[str, object]:
    """A batch job's model (None: the fleet's default) -> (the name its output line gives, its tokenizer)."""
    try:
        served = services().fleet.resolve(name)
    except ModelNotServed:  # served no longer: its line still names it, its tokens by id
        return str(name), None
    return served.name, tokenizer_for(served.model)


def owned_batch(batch_id: str) -> Batch:
    """404 for a batch that does not exist or belongs to another tenant (indistinguishable on purpose)."""
    batch = batches.get_batch(db(), batch_id, current_tenant().id) if OBJECT_ID.fullmatch(batch_id) else None
    if batch is None:
        raise APIError(404, "not_found", f"no such batch: {batch_id}")
    return batch


def batch_object(batch: Batch) -> dict:
    total, completed, failed = batches.request_counts(db(), batch)
    counts = RequestCounts(total=total, completed=completed, failed=failed)
    return BatchObject.of(batch, counts, batch_model(batch)).model_dump()


def batch_model(batch: Batch) -> str | None:
    """OpenAI's Batch.model, the model of the batch's requests: the one its valid lines run on (a line naming a
    model the fleet does not serve runs on none); None when they run on several (each output line names its own;
    OpenAI takes one model a file) or when none runs. A
    batch created before batches kept their models (batches.models NULL) names the fleet's default, as it did."""
    if batch.models is None:
        return services().settings.model
    return batch.models[0] if len(batch.models) == 1 else None
