"""POST /jobs/bulk: many jobs in one call, each answered as POST /jobs would answer it alone (validation,
Idempotency-Key, the queued-job caps), inserted in one statement and sent to Redis in one pipeline."""

from __future__ import annotations

import json
import logging

import orjson
from flask import Blueprint
from kombu.exceptions import KombuError
from pydantic import ValidationError
from redis.exceptions import RedisError

from contract.dispatch import model_queue
from contract.tracing import current_traceparent
from jobstore.bulk_jobs import BulkItem, BulkResult, Outcome, create_jobs
from webapi.auth import current_tenant, require_api_key
from webapi.bulk_schemas import BulkItemResult, BulkResults, BulkSubmit, QueueRoom
from webapi.errors import APIError, from_validation_error
from webapi.extensions import services
from webapi.gc_pause import gc_paused
from webapi.jobs import job_request, overloaded_error
from webapi.metrics import JOBS_SUBMITTED
from webapi.schemas import ErrorInfo, JobOut, JobSubmit
from webapi.spec import endpoint, validation_context
from webapi.tenant_limits import check_priority, tenant_policy, token_budget

log = logging.getLogger(__name__)
bp = Blueprint("bulk_jobs", __name__, url_prefix="/jobs")
bp.before_request(require_api_key)


@bp.post("/bulk")
@endpoint(body=BulkSubmit, responses={200: BulkResults})
@gc_paused()
def submit_jobs(body: BulkSubmit):
    """Submit many jobs at once; each item's result says what POST /jobs would have said for it alone."""
    tenant_id, cap = current_tenant().id, tenant_policy().max_queued
    budget = token_budget()
    errors: dict[int, APIError] = {}
    items: list[tuple[int, BulkItem]] = []
    for index, raw in enumerate(body.jobs):
        try:
            item = bulk_item(raw)
            check_priority(item.request["priority"])
            budget.spend(item.prompt_tokens + item.request["max_tokens"])  # a retried key's job spends too
            items.append((index, item))
        except APIError as exc:
            errors[index] = exc
    overloaded = overloaded_error()
    with services().engine.begin() as conn:
        found, queued = create_jobs(
            conn,
            tenant_id,
            [item for _, item in items],
            max_queued=0 if overloaded else cap,
            traceparent=current_traceparent(),  # TRACING: the jobs join this request's trace
        )
    outcomes = dict(zip((index for index, _ in items), found))
    send([r.job for r in found if r.outcome is Outcome.CREATED])
    results = [
        item_result(index, outcomes.get(index), errors.get(index), overloaded, cap)
        for index in range(len(body.jobs))
    ]
    return BulkResults(results=results, queue=QueueRoom(queued=queued, max_queued=cap)).model_dump(
        mode="json"
    )


def bulk_item(raw: dict) -> BulkItem:
    """One item validated as a POST /jobs body (its `idempotency_key` as the header); APIError if refused."""
    fields = dict(raw)
    key = fields.pop("idempotency_key", None)
    if key is not None and not (isinstance(key, str) and 1 <= len(key) <= 255 and key.isprintable()):
        raise APIError(422, "invalid_request", "idempotency_key: must be 1 to 255 printable characters")
    try:  # from JSON, as POST /jobs parses its body (strict types: a deadline is a string in JSON)
        submit = JobSubmit.model_validate_json(_as_json(fields), context=validation_context())
    except ValidationError as exc:
        raise from_validation_error(exc, document=fields) from None
    request, prompt_tokens = job_request(submit)
    return BulkItem(request, prompt_tokens, key)


def _as_json(fields: dict) -> bytes | str:
    """An item's fields as JSON again. orjson refuses integers beyond 64 bits, which the body's parser took:
    the standard library writes them, and validation names the field they are too large for."""
    try:
        return orjson.dumps(fields)
    except TypeError:
        return json.dumps(fields)


def item_result(
    index: int, found: BulkResult | None, error: APIError | None, overloaded: APIError | None, cap: int
) -> BulkItemResult:
    if found is not None and found.outcome is Outcome.KEY_CONFLICT:
        error = APIError(422, "idempotency_key_reused", "idempotency_key: already used with a different body")
    elif found is not None and found.outcome is Outcome.AT_CAP:
        error = overloaded or APIError(
            429,
            "too_many_queued_jobs",
            f"max_queued: you have {cap} jobs queued, the most allowed; retry when some have started",
        )
    if error is not None:
        info = ErrorInfo(code=error.code, message=error.message)
        return BulkItemResult(index=index, status=error.status, created=False, job=None, error=info)
    return BulkItemResult(
        index=index,
        status=202,
        created=found.outcome is Outcome.CREATED,
        job=JobOut.from_job(found.job),
        error=None,
    )


def send(jobs) -> None:
    """Send the new jobs to Redis, most urgent first, in one pipeline; if Redis is down they stay queued
    unsent and the reconciler sends them (they are in Postgres)."""
    if not jobs:
        return
    ordered = sorted(jobs, key=lambda job: job.priority)
    by_queue: dict[str, list] = {}  # each model's jobs to its own queue
    for job in ordered:
        by_queue.setdefault(model_queue(services().settings, job.model), []).append(job)
    try:
        for queue, group in by_queue.items():
            services().bulk_sender.send(((job.id, job.priority) for job in group), queue)
    except (KombuError, RedisError, OSError) as exc:
        log.warning("%d jobs stay queued unsent (the reconciler will send them): %s", len(jobs), exc)
        return
    for job in ordered:
        services().sent_marks.add(job.id)
        services().queue_size.accepted(job.tenant_id)
        JOBS_SUBMITTED.labels(priority=str(job.priority)).inc()
