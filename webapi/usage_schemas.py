"""Bodies of GET /usage: what the caller's jobs used over a period."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from jobstore.models import JobStatus
from jobstore.usage import UsageRow


class UsageQuery(BaseModel):
    """Query string of GET /usage."""

    model_config = ConfigDict(extra="forbid")

    since: datetime | None = Field(
        None,
        description="Jobs created from this time (ISO 8601 with its zone); default: the start of the "
        "tenant's budget period (a UTC day unless its policy says otherwise).",
    )
    until: datetime | None = Field(None, description="... and before this time; default: now.")


class JobCounts(BaseModel):
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0


class UsageTotals(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    jobs: JobCounts

    @classmethod
    def of(cls, rows: list[UsageRow]) -> UsageTotals:
        jobs = JobCounts()
        for row in rows:
            setattr(jobs, JobStatus(row.status).value, getattr(jobs, JobStatus(row.status).value) + row.jobs)
        return cls(
            prompt_tokens=sum(r.prompt_tokens for r in rows),
            completion_tokens=sum(r.completion_tokens for r in rows),
            jobs=jobs,
        )


class ModelUsage(UsageTotals):
    model: str


class BudgetState(BaseModel):
    budget: int
    used: int = Field(description="Tokens used or reserved (a live job counts its max_tokens) this period.")
    period_start: datetime
    resets_at: datetime


class UsageOut(BaseModel):
    """What the caller's jobs created in [since, until) used: tokens (a running job's so far) and jobs by status,
    in all and per model; and where its token budget stands, if it has one."""

    tenant: str
    since: datetime
    until: datetime
    prompt_tokens: int
    completion_tokens: int
    jobs: JobCounts
    models: list[ModelUsage] = Field(
        description="Per model, by name (a job that named none: the fleet's default model's)."
    )
    token_budget: BudgetState | None
