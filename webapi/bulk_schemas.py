"""Bodies of the calls on many jobs at once: POST /jobs/bulk and GET /jobs/ended."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.fields import RequestBody
from webapi.schemas import ErrorInfo, JobOut

MAX_BULK_JOBS = 1000  # jobs one POST /jobs/bulk may carry (its body is also bounded by MAX_BODY_BYTES)
MAX_ENDED_PAGE = 1000


class BulkSubmit(RequestBody):
    """Body of POST /jobs/bulk: each item is a POST /jobs body, plus its own `idempotency_key` (each item is
    validated on its own, and answered in its own result)."""

    jobs: list[dict[str, Any]] = Field(
        min_length=1,
        max_length=MAX_BULK_JOBS,
        description="POST /jobs bodies; each may add `idempotency_key` (1-255 printable characters), "
        "with the Idempotency-Key header's meaning for that item.",
    )


class QueueRoom(BaseModel):
    """The caller's queued jobs (submitted through /jobs, not a batch's) against its cap."""

    queued: int
    max_queued: int


class BulkItemResult(BaseModel):
    """One item's answer: `status` is what POST /jobs would have answered for it alone."""

    index: int = Field(description="The item's place in `jobs`, from 0.")
    status: int = Field(
        description="202: queued (or, `created` false, the job its key made before); else 4xx."
    )
    created: bool
    job: JobOut | None
    error: ErrorInfo | None


class BulkResults(BaseModel):
    """POST /jobs/bulk's answer: one result per item, in order."""

    results: list[BulkItemResult]
    queue: QueueRoom


class EndedQuery(BaseModel):
    """Query string of GET /jobs/ended."""

    model_config = ConfigDict(extra="forbid")

    since: str | None = Field(
        None,
        max_length=200,
        description="Where to start: an ISO 8601 time with its zone (jobs that ended after it), or a "
        "`next_cursor`; absent, the call's own time (nothing listed, a cursor to follow from).",
    )
    limit: int = Field(MAX_ENDED_PAGE, ge=1, le=MAX_ENDED_PAGE, description="Jobs per page.")


class EndedPage(BaseModel):
    """Jobs that ended (succeeded, failed, cancelled) after `since`, in the order they ended."""

    jobs: list[JobOut]
    next_cursor: str = Field(
        description="Pass as `since` for what ends next. The last few seconds are listed again on the next "
        "call (a job's end commits a moment after its time is taken): skip ids already seen."
    )
    more: bool = Field(description="True when more jobs ended than this page holds: call again at once.")
    queue: QueueRoom
