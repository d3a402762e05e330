"""Request and response bodies. They validate requests and, through webapi/spec.py, make /openapi.json."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from jobstore.dispatch import DEFAULT_PRIORITY
from jobstore.models import Job, JobStatus

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FinishReason = Literal["stop", "length", "abort"]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)] | int | float | bool | None


class JobCreate(BaseModel):
    """A generation job: a prompt (text or token ids) and how to sample its continuation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = Field(None, min_length=1, description="Text to continue. Give this or input_ids.")
    input_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        None, min_length=1, description="Token ids to continue, used as they are. Give this or prompt.")
    max_tokens: int = Field(64, ge=1, description="Most tokens to generate; prompt + max_tokens <= max_model_len.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 samples greedily.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling; 1 is off.")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens; 0 is off.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same tokens, whatever the batch.")
    stop: list[StopString] = Field(default_factory=list, max_length=8, description="Stop before these strings.")
    priority: int = Field(DEFAULT_PRIORITY, ge=0, le=9, description="0 is the most urgent, 9 the least.")
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict, max_length=16, description="Your own labels, returned with the job.")

    @field_validator("stop", "metadata")
    @classmethod
    def no_nul(cls, value):
        """Postgres text and JSON cannot hold NUL characters; refuse them rather than fail later."""
        if _has_nul(value):
            raise ValueError("NUL characters are not supported")
        return value

    @model_validator(mode="after")
    def prompt_xor_input_ids(self) -> JobCreate:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `prompt` or `input_ids`")
        return self


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(map(_has_nul, value))
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


class ListQuery(BaseModel):
    """Query string of GET /jobs."""

    model_config = ConfigDict(extra="forbid")

    status: Status | None = Field(None, description="Only jobs with this status.")
    limit: int = Field(20, ge=1, le=100, description="Jobs per page.")
    cursor: str | None = Field(None, max_length=200, description="`next_cursor` of the previous page.")


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


class JobOut(BaseModel):
    """A job as its owner sees it. While it runs, `output` holds the tokens generated so far."""

    id: uuid.UUID
    status: Status
    priority: int
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    output: JobOutput
    usage: Usage
    error: ErrorInfo | None
    metadata: dict[str, MetadataValue]

    @classmethod
    def from_job(cls, job: Job) -> JobOut:
        error = ErrorInfo(code=job.error_code, message=job.error_message or "") if job.error_code else None
        return cls(
            id=job.id, status=JobStatus(job.status).value, priority=job.priority, created_at=job.created_at,
            started_at=job.started_at, first_token_at=job.first_token_at, finished_at=job.finished_at,
            output=JobOutput(text=job.output_text, token_ids=job.output_token_ids, finish_reason=job.finish_reason),
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=len(job.output_token_ids)),
            error=error, metadata=job.metadata_,
        )


class JobPage(BaseModel):
    """One page of jobs, newest first."""

    jobs: list[JobOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class Health(BaseModel):
    status: Literal["ok"]
    database: Literal["ok"]
    broker: Literal["ok"]
