"""GET /jobs/ended: the caller's jobs that ended since a cursor, in the order they ended. A client following
many jobs (genq-batch) reads what ended with one call a poll, not a GET per pending job.

A job's end is written with the time its statement started (finished_at = now()) and seen once it commits,
a moment later: a cursor that passed that time would skip it. So the cursor of a last page (`more` false)
is never later than SETTLE_SECONDS before the query's own time: what ended in those last seconds is listed
again on the next call, and the caller skips the ids it has seen. A page with `more` hands back its last
job's position, so a long run of ends is read through page by page."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from datetime import datetime, timedelta, timezone

from flask import Blueprint
from sqlalchemy import func, select

from jobstore import jobs
from webapi.auth import current_tenant, require_api_key
from webapi.bulk_schemas import EndedPage, EndedQuery, QueueRoom
from webapi.errors import APIError
from webapi.extensions import services
from webapi.schemas import JobOut
from webapi.spec import endpoint
from webapi.tenant_limits import tenant_policy

bp = Blueprint("ended_jobs", __name__, url_prefix="/jobs")
bp.before_request(require_api_key)
SETTLE_SECONDS = 1.0  # longer than any commit of a job's end takes after its statement started
LAST_ID = uuid.UUID(int=(1 << 128) - 1)


@bp.get("/ended")
@endpoint(query=EndedQuery, responses={200: EndedPage})
def ended_jobs(query: EndedQuery):
    """The caller's jobs that ended after `since` (a time or a cursor), in the order they ended."""
    with services().autocommit.connect() as conn:
        now = conn.scalar(select(func.statement_timestamp()))
        after = position(query.since) if query.since is not None else (now, LAST_ID)
        page = jobs.jobs_ended_after(conn, current_tenant().id, after, query.limit + 1)
    more, page = len(page) > query.limit, page[: query.limit]
    settled = (now - timedelta(seconds=SETTLE_SECONDS), LAST_ID)
    last = (page[-1].finished_at, page[-1].id) if page else after
    cursor = encode(last if more else min(last, settled))
    tenant_id = current_tenant().id
    room = QueueRoom(queued=services().queue_size.of(tenant_id), max_queued=tenant_policy().max_queued)
    return EndedPage(
        jobs=[JobOut.from_job(job) for job in page], next_cursor=cursor, more=more, queue=room
    ).model_dump(mode="json")


def position(since: str) -> tuple[datetime, uuid.UUID]:
    """(finished_at, id) to list after: a cursor this API gave out, or an ISO 8601 time (with its zone)."""
    try:
        when = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        return decode(since)
    if when.tzinfo is None:
        raise APIError(422, "invalid_request", "since: give the time's zone (e.g. 2026-11-27T00:00:00Z)")
    return when, uuid.UUID(int=0)


def encode(at: tuple[datetime, uuid.UUID]) -> str:
    raw = json.dumps([at[0].astimezone(timezone.utc).isoformat(), str(at[1])]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        when, job_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(when), uuid.UUID(job_id)
    except (ValueError, TypeError, binascii.Error):
        raise APIError(
            422, "invalid_request", "since: neither an ISO 8601 time nor a cursor this API gave out"
        ) from None
