"""Request and response bodies. They validate requests and, through webapi/spec.py, make /openapi.json."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from contract.fields import drop_nulls
from contract.requests import JobCreate, MetadataValue
from contract.settings import StoreSettings
from jobstore.job_events import job_events
from jobstore.models import Job, JobStatus
from webapi.openai_schemas import ChatMessage

__all__ = ["JobCreate"]  # defined in jobstore (the worker validates stored jobs with it too)


class JobSubmit(JobCreate):
    """Body of POST /jobs: a job whose prompt is text, token ids, or chat messages. Messages are rendered
    with the model's chat template (add_generation_prompt) and stored as the job's input_ids. A field given
    as null takes its default, as on /v1."""

    messages: list[ChatMessage] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Chat messages (OpenAI's format), rendered by the server. Give this, prompt or input_ids.",
    )

    @model_validator(mode="before")
    @classmethod
    def null_is_unset(cls, data):
        return drop_nulls(data)

    @field_validator("deadline")
    @classmethod
    def deadline_ahead(cls, value: datetime | None) -> datetime | None:
        """A deadline is in the future when the job is submitted (a stored job's may have passed since)."""
        now = datetime.now(timezone.utc)
        if value is not None and value <= now:
            raise ValueError(
                f"must be in the future; got {value.isoformat()}, and it is {now.isoformat(timespec='seconds')}"
            )
        return value

    @model_validator(mode="after")
    def prompt_xor_input_ids(self) -> JobSubmit:  # replaces JobCreate's: a third way to give the prompt
        if sum(value is not None for value in (self.prompt, self.input_ids, self.messages)) != 1:
            raise ValueError("give exactly one of `prompt`, `input_ids` or `messages`")
        return self


Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FinishReason = Literal["stop", "length", "abort"]
DeadlineStatus = Literal["on_track", "at_risk", "met", "missed"]


class ListQuery(BaseModel):
    """Query string of GET /jobs."""

    model_config = ConfigDict(extra="forbid")

    status: Status | None = Field(None, description="Only jobs with this status.")
    limit: int = Field(20, ge=1, le=100, description="Jobs per page.")
    cursor: str | None = Field(None, max_length=200, description="`next_cursor` of the previous page.")


MAX_WAIT_SECONDS = 60


class JobQuery(BaseModel):
    """Query string of GET /jobs/<id>."""

    model_config = ConfigDict(extra="forbid")

    wait: float | None = Field(
        None,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description=f"Answer when the job ends, or after this many seconds at most ({MAX_WAIT_SECONDS}).",
    )


class JobOutput(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None


class Usage(BaseModel):
    prompt_tokens: int | None
    completion_tokens: int


class ErrorInfo(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    """Every error answer has this shape."""

    error: ErrorInfo


class JobEventOut(BaseModel):
    """Something the job lived that its other fields keep no time of (jobstore/job_events.py); a field that does
    not apply to its kind is left out."""

    kind: Literal["claimed", "preempted", "resumed", "handed_back", "lease_expired"]
    at: datetime
    attempt: int | None = Field(None, description="claimed: which claim this is (the first is `started_at`).")
    count: int | None = Field(None, description="preempted: how many times since it last made tokens.")
    reason: Literal["preempted", "handed_back", "rebalanced", "engine_lost"] | None = Field(
        None,
        description="handed_back: for more urgent work, its worker shutting down, for an idle worker with free "
        "slots, or its engine process dying.",
    )
    tokens: int | None = Field(None, description="handed_back: the output tokens it kept.")

    @model_serializer(mode="wrap")
    def _absent_fields_left_out(self, serialize):
        return drop_nulls(serialize(self))


class JobOut(BaseModel):
    """A job as its owner sees it. While it runs, `output` holds the tokens generated so far."""

    id: uuid.UUID
    status: Status
    priority: int
    model: str | None = Field(None, description="The served model it runs on (null: the fleet's default).")
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    output: JobOutput
    usage: Usage
    error: ErrorInfo | None
    metadata: dict[str, MetadataValue]
    logprobs: dict[str, list | None] | None = Field(
        None,
        description='With `logprobs` / `prompt_logprobs`, once the job succeeded: {"tokens": [...], "prompt": [...]}, '
        "each entry [token_id, logprob, [[id, logprob], ...]] (the prompt's first token's logprob is null).",
    )
    events: list[JobEventOut] = Field(
        default_factory=list,
        description="Re-claims, preemptions inside the engine and resumes, hand-backs to the queue and lease "
        "expiries, in the order they happened (a job that ran straight through has none).",
    )
    deadline: datetime | None = Field(None, description="When its result is wanted (null: no deadline).")
    deadline_status: DeadlineStatus | None = Field(
        None,
        description="Ended: `met` (succeeded by its deadline) or `missed`. Queued or running: `missed` past its "
        "deadline, `at_risk` within DEADLINE_MARGIN_SECONDS of it, else `on_track`. Null without a deadline.",
    )

    @classmethod
    def from_job(cls, job: Job) -> JobOut:
        error = ErrorInfo(code=job.error_code, message=job.error_message or "") if job.error_code else None
        return cls(
            id=job.id,
            status=JobStatus(job.status).value,
            priority=job.priority,
            model=job.model,
            created_at=job.created_at,
            started_at=job.started_at,
            first_token_at=job.first_token_at,
            finished_at=job.finished_at,
            output=JobOutput(
                text=job.output_text, token_ids=job.output_token_ids, finish_reason=job.finish_reason
            ),
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=len(job.output_token_ids)),
            error=error,
            metadata=job.metadata_,
            logprobs=job.logprobs,
            events=[JobEventOut(**e.public()) for e in job_events(job.events)] if job.events else [],
            deadline=job.deadline,
            deadline_status=deadline_status(job, datetime.now(timezone.utc), _deadline_margin()),
        )


def deadline_status(job: Job, now: datetime, margin_seconds: float) -> DeadlineStatus | None:
    """Where a job stands against its deadline at `now` (JobOut.deadline_status)."""
    deadline = job.deadline
    if deadline is None:
        return None
    if JobStatus(job.status).finished:
        met = (
            job.status == JobStatus.SUCCEEDED and job.finished_at is not None and job.finished_at <= deadline
        )
        return "met" if met else "missed"
    left = (deadline - now).total_seconds()
    return "missed" if left < 0 else "at_risk" if left < margin_seconds else "on_track"


def _deadline_margin() -> float:
    """DEADLINE_MARGIN_SECONDS of the app answering (its default outside one)."""
    from flask import current_app, has_app_context

    found = current_app.extensions.get("genq") if has_app_context() else None
    settings = getattr(found, "settings", None)
    default: float = StoreSettings.model_fields["deadline_margin_seconds"].default
    return getattr(settings, "deadline_margin_seconds", default)


class JobPage(BaseModel):
    """One page of jobs, newest first."""

    jobs: list[JobOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class Health(BaseModel):
    status: Literal["ok"]
    database: Literal["ok"]
    broker: Literal["ok"]


class Version(BaseModel):
    version: str
