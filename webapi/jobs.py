"""/jobs: submit, read, list and cancel the caller's jobs."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime

from flask import Blueprint, request, url_for
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from contract.deltas import Position
from contract.dispatch import model_queue
from contract.tracing import current_traceparent
from jobstore import jobs
from jobstore.models import Job, JobStatus
from webapi.auth import current_tenant, require_api_key
from webapi.cancels import cancel
from webapi.errors import APIError
from webapi.extensions import db, services
from webapi.fleet import FleetModel, ModelNotServed
from webapi.following import JobFollower
from webapi.job_stream import delta_event, job_event_pieces
from webapi.metrics import JOBS_SUBMITTED
from webapi.prompts import NoChatTemplate, check_length, prepare_prompt
from webapi.schemas import JobOut, JobPage, JobQuery, JobSubmit, ListQuery
from webapi.spec import endpoint
from webapi.tenant_limits import check_priority, tenant_policy, token_budget

log = logging.getLogger(__name__)
bp = Blueprint("jobs", __name__, url_prefix="/jobs")
bp.before_request(require_api_key)

IDEMPOTENCY_HELP = "Retrying with the same key returns the same job (a different body is a 422)."
LAST_EVENT_ID_HELP = "The id of the last event received: the stream goes on after it, nothing sent twice."


@bp.post("")
@endpoint(
    body=JobSubmit, responses={202: JobOut}, errors=(403,), headers={"Idempotency-Key": IDEMPOTENCY_HELP}
)
def create_job(body: JobSubmit):
    """Submit a job; it is queued at once and runs in priority order (0 first)."""
    request, prompt_tokens = job_request(body)
    job = submit_job(request, prompt_tokens, idempotency_key())
    return (
        JobOut.from_job(job).model_dump(mode="json"),
        202,
        {"Location": url_for("jobs.get_job", job_id=job.id)},
    )


def submit_job(
    request: dict, prompt_tokens: int, key: str | None = None, on_created: Callable[[Job], None] | None = None
) -> Job:
    """Insert the caller's job (JobCreate's fields) and send it to Redis; 429 over the queued-job caps, 422
    for an Idempotency-Key reused with another body. POST /jobs and /v1's synchronous completions.
    `on_created(job)` runs between the two (a caller following the job subscribes to its events there)."""
    tenant_id, cap = current_tenant().id, tenant_policy().max_queued
    check_priority(request["priority"])
    token_budget().spend(prompt_tokens + request["max_tokens"])
    # counted apart (webapi/queue_size.py), before taking a connection: a count never waits on a second one
    near_cap = services().queue_size.of(tenant_id) >= cap // 2  # below: see webapi/queue_size.py
    overloaded = overloaded_error()
    # one INSERT on an autocommit connection; near its cap, a transaction: the tenant's lock, then the INSERT
    # with the tenant's count inside it (jobstore.jobs.create_job), so racing submissions cannot overshoot
    found = services()
    with found.engine.begin() if near_cap else found.autocommit.connect() as conn:
        if overloaded and (key is None or jobs.job_for_key(conn, tenant_id, key) is None):
            raise overloaded  # a retry of a job is answered, not a new job
        try:
            job, created = jobs.create_job(
                conn,
                tenant_id,
                request,
                prompt_tokens=prompt_tokens,
                idempotency_key=key,
                max_queued=cap if near_cap else None,
                traceparent=current_traceparent(),  # TRACING: the worker's spans join this request's trace
            )
        except jobs.IdempotencyConflict:
            raise APIError(
                422, "idempotency_key_reused", "Idempotency-Key: already used with a different body"
            ) from None
    if job is None:
        raise APIError(
            429,
            "too_many_queued_jobs",
            f"max_queued: you have {cap} jobs queued, the most allowed; retry when some have started",
            {"Retry-After": "5"},
        )
    if created:
        if on_created is not None:
            on_created(job)
        enqueue(job)
    return job


@bp.get("/<uuid:job_id>")
@endpoint(query=JobQuery, responses={200: JobOut})
def get_job(job_id: uuid.UUID, query: JobQuery):
    """Read a job: its status, and its output so far; with `wait`, once it ends or the wait runs out."""
    job = find_job(job_id)
    if query.wait and not JobStatus(job.status).finished:
        job = wait_for(job, query.wait)
    return JobOut.from_job(job).model_dump(mode="json")


@bp.get("/<uuid:job_id>/events")
@endpoint(responses={200: None}, headers={"Last-Event-ID": LAST_EVENT_ID_HELP})
def job_events(job_id: uuid.UUID):
    """Follow a job as server-sent events: status changes, text deltas as they are made, the result."""
    job, since = find_job(job_id), last_event_id()
    with JobFollower(services()) as follower:
        follower.follow(job)
        return follower.stream(job_event_pieces(follower, since), plain=delta_event)


@bp.get("")
@endpoint(query=ListQuery, responses={200: JobPage})
def list_jobs(query: ListQuery):
    """List the caller's jobs, newest first, a page at a time."""
    page = jobs.list_jobs(
        db(),
        current_tenant().id,
        status=query.status and JobStatus(query.status),
        limit=query.limit + 1,
        before=decode_cursor(query.cursor),
    )
    more = len(page) > query.limit
    page = page[: query.limit]
    cursor = encode_cursor(page[-1]) if more else None
    return JobPage(jobs=[JobOut.from_job(j) for j in page], next_cursor=cursor).model_dump(mode="json")


@bp.post("/<uuid:job_id>/cancel")
@endpoint(responses={200: JobOut}, errors=(409,))
def cancel_job(job_id: uuid.UUID):
    """Cancel a queued or running job; a running one leaves the batch within a second."""
    found, cancelled = cancel(services(), job_id, current_tenant().id)
    job = owned_job(found)
    if job.status != JobStatus.CANCELLED:
        raise APIError(409, "conflict", f"job already {JobStatus(job.status).value}; it cannot be cancelled")
    if cancelled:  # a repeated cancel answers the same
        log.info("job %s cancelled by tenant %s", job.id, current_tenant().name)
    return JobOut.from_job(job).model_dump(mode="json")


def wait_for(job: Job, seconds: float) -> Job:
    """The job once it ends, or as it is after `seconds`; holds a waiting slot meanwhile."""
    with JobFollower(services(), timeout=seconds) as follower:
        follower.follow(job, row=job)
        return follower.wait() or owned_job(follower.row())


def last_event_id() -> Position:
    """Where a reconnecting client stopped: the Last-Event-ID header (or `last_event_id` in the query)."""
    value = request.headers.get("Last-Event-ID", request.args.get("last_event_id"))
    if value is None:
        return Position()
    position = Position.parse(value)
    if position is None:
        raise APIError(422, "invalid_request", "Last-Event-ID: not an event id this API gave out")
    return position


def find_job(job_id: uuid.UUID) -> Job:
    """The caller's job, read on an autocommit connection given back at once: a call that then waits or
    streams holds no database connection (a request's session would hold one until the response ends)."""
    with services().autocommit.connect() as conn:
        return owned_job(jobs.get_job(conn, job_id, current_tenant().id))


def owned_job(job: Job | None) -> Job:
    """404 for a job that does not exist or belongs to another tenant (indistinguishable on purpose)."""
    if job is None:
        raise APIError(404, "not_found", "no such job")
    return job


def overloaded_error() -> APIError | None:
    """429 with Retry-After when all tenants together have MAX_QUEUED_JOBS queued (counted once a second)."""
    if services().queue_size.total() >= services().settings.max_queued_jobs:
        return APIError(
            429, "overloaded", "the service has too many jobs queued; retry later", {"Retry-After": "10"}
        )
    return None


def job_request(body: JobSubmit) -> tuple[dict, int]:
    """The job's stored fields (chat messages rendered into input_ids) and its prompt token count; 422 when
    the prompt cannot run on the model (no chat template, unknown token ids, too long)."""
    served = served_model(body.model)
    request = body.model_dump(exclude={"messages"})
    request["model"] = served.name
    messages = None if body.messages is None else [m.for_template() for m in body.messages]
    try:
        ids, prompt_tokens, error = prepare_prompt(served.model, messages, body.input_ids, body.prompt)
    except NoChatTemplate as exc:
        raise APIError(422, "invalid_request", str(exc)) from None
    if messages is not None and error is None:
        request["input_ids"] = ids
    field = "messages" if body.messages is not None else "prompt" if body.prompt is not None else "input_ids"
    defaulted = "max_tokens" not in body.model_fields_set
    error = error or check_length(
        prompt_tokens, body.max_tokens, served.max_model_len, field, defaulted=defaulted
    )
    if error is not None:
        raise APIError(422, "invalid_request", str(error))
    return request, prompt_tokens


def served_model(name: str | None) -> FleetModel:
    """The served model a request's `model` names (None: the fleet's default); 404 model_not_found otherwise."""
    try:
        return services().fleet.resolve(name)
    except ModelNotServed as exc:
        raise APIError(404, "model_not_found", str(exc)) from None


def enqueue(job: Job) -> None:
    """Send the committed job to Redis; if Redis is down the reconciler sends it later (it is in Postgres).

    The send is recorded (enqueued_at) in batches, off the request path: webapi/sent_marks.py."""
    try:
        services().bulk_sender.send_one(job.id, job.priority, model_queue(services().settings, job.model))
    except (KombuError, RedisError, OSError) as exc:
        log.warning("job %s stays queued unsent (the reconciler will send it): %s", job.id, exc)
        return
    services().sent_marks.add(job.id)
    services().queue_size.accepted(job.tenant_id)
    JOBS_SUBMITTED.labels(priority=str(job.priority)).inc()
    log.debug("job %s queued for tenant %s with priority %d", job.id, current_tenant().name, job.priority)


def idempotency_key() -> str | None:
    """The Idempotency-Key header, if any."""
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 255:
        raise APIError(422, "invalid_request", "Idempotency-Key: must be 1 to 255 characters")
    if key is not None and not key.isprintable():
        raise APIError(422, "invalid_request", "Idempotency-Key: control characters are not allowed")
    return key


def encode_cursor(job: Job) -> str:
    """An opaque position after `job` in newest-first order."""
    raw = json.dumps([job.created_at.isoformat(), str(job.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if cursor is None:
        return None
    try:
        created_at, job_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(created_at), uuid.UUID(job_id)
    except (ValueError, TypeError, binascii.Error):
        raise APIError(422, "invalid_request", "cursor: not a cursor this API gave out") from None
