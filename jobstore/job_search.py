"""Jobs across tenants for an operator (the admin page): filtered by status, priority, tenant, newest first."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobstore.models import Job, JobStatus, Tenant


def search_jobs(
    db: Session,
    *,
    status: JobStatus | None = None,
    priority: int | None = None,
    tenant: str | None = None,
    model: str | None = None,
    default_model: str = "",
    limit: int = 100,
) -> list[tuple[Job, str]]:
    """(job, its tenant's name) of every tenant, newest first, matching every filter given (a job that names
    no model runs on `default_model`, the fleet's default)."""
    stmt = select(Job, Tenant.name).join(Tenant, Tenant.id == Job.tenant_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if priority is not None:
        stmt = stmt.where(Job.priority == priority)
    if tenant:
        stmt = stmt.where(Tenant.name == tenant)
    if model:
        stmt = stmt.where(func.coalesce(Job.model, default_model) == model)
    return [
        (job, name)
        for job, name in db.execute(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit))
    ]
