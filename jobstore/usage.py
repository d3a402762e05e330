"""What tenants' jobs used: jobs by status and prompt and completion tokens, over the jobs created in a
period (a job counts whole in the period it was created in; a running job its tokens so far). GET /usage,
the admin page and the per-tenant metrics read it; its sums are those of the jobs' own `usage`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from jobstore.models import Job, JobStatus, Tenant


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant_id: uuid.UUID
    tenant: str
    model: str
    status: JobStatus
    jobs: int
    prompt_tokens: int
    completion_tokens: int


def usage_rows(
    db: Session | Connection,
    since: datetime,
    until: datetime,
    tenant_id: uuid.UUID | None = None,
    *,
    default_model: str,
) -> list[UsageRow]:
    """Per tenant, model and status: jobs created in [since, until), and their tokens (one GROUP BY). A job
    that names no model (one written before jobs did) counts under `default_model`, the fleet's default."""
    model = func.coalesce(Job.model, default_model)
    stmt = (
        select(
            Job.tenant_id,
            Tenant.name,
            model,
            Job.status,
            func.count(),
            func.coalesce(func.sum(func.coalesce(Job.prompt_tokens, 0)), 0),
            func.coalesce(func.sum(func.cardinality(Job.output_token_ids)), 0),
        )
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.created_at >= since, Job.created_at < until)
        .group_by(Job.tenant_id, Tenant.name, model, Job.status)
    )
    if tenant_id is not None:
        stmt = stmt.where(Job.tenant_id == tenant_id)
    return [
        UsageRow(t, name, m, JobStatus(s), int(n), int(p), int(c))
        for t, name, m, s, n, p, c in db.execute(stmt)
    ]
