"""Per-tenant policy: the limits a tenant's requests meet, stored in tenant_policies (a NULL column, or no
row, takes the API's default, so a tenant nobody configured behaves as every tenant did before).

- top_priority: the most urgent priority its keys may ask for (0 most urgent; a more urgent one is refused);
- sync_priority: the priority of its synchronous /v1 calls that name none (never more urgent than top_priority);
- max_queued: its queued-job cap (default MAX_QUEUED_PER_TENANT); rate_limit: each of its keys' (RATE_LIMIT);
- token_budget per budget_period_seconds: the tokens its jobs may use in a period (prompt + completion; a
  job still queued or running counts its max_tokens, so racing requests cannot spend past the budget by
  much). Periods are aligned on the Unix epoch (86400: UTC days); the budget resets when one ends.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone

from limits import parse_many
from sqlalchemy import Connection, case, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobstore.models import Job, JobStatus, Tenant, TenantPolicy

DEFAULT_PERIOD_SECONDS = 86400
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """A tenant's row as stored: None is "the default"."""

    top_priority: int | None = None
    sync_priority: int | None = None
    max_queued: int | None = None
    rate_limit: str | None = None
    token_budget: int | None = None
    budget_period_seconds: int = DEFAULT_PERIOD_SECONDS


POLICY_FIELDS = tuple(f.name for f in fields(StoredPolicy))


@dataclass(frozen=True, slots=True)
class Policy:
    """The limits in force for a tenant: its stored values, the API's defaults where it has none."""

    top_priority: int
    sync_priority: int
    max_queued: int
    rate_limit: str
    token_budget: int | None
    budget_period_seconds: int

    @classmethod
    def resolve(cls, stored: StoredPolicy | None, *, max_queued: int, rate_limit: str) -> Policy:
        stored = stored or StoredPolicy()
        top = stored.top_priority or 0
        return cls(
            top_priority=top,
            sync_priority=max(stored.sync_priority or 0, top),
            max_queued=max_queued if stored.max_queued is None else stored.max_queued,
            rate_limit=stored.rate_limit or rate_limit,
            token_budget=stored.token_budget,
            budget_period_seconds=stored.budget_period_seconds,
        )

    def budget_window(self, now: datetime) -> tuple[datetime, datetime]:
        """(start, end) of the budget period holding `now`."""
        period = self.budget_period_seconds
        start = EPOCH + timedelta(seconds=(now - EPOCH).total_seconds() // period * period)
        return start, start + timedelta(seconds=period)


def stored_policy(db: Session | Connection, tenant_id: uuid.UUID) -> StoredPolicy | None:
    row = db.execute(
        select(*(getattr(TenantPolicy, name) for name in POLICY_FIELDS)).where(
            TenantPolicy.tenant_id == tenant_id
        )
    ).one_or_none()
    return None if row is None else StoredPolicy(*row)


def check_values(values: dict) -> None:
    """ValueError naming the field when a value cannot be stored."""
    for name in ("top_priority", "sync_priority"):
        if values.get(name) is not None and not 0 <= values[name] <= 9:
            raise ValueError(f"{name}: give 0 (most urgent) to 9, got {values[name]}")
    for name in ("max_queued", "token_budget"):
        if values.get(name) is not None and values[name] < 0:
            raise ValueError(f"{name}: must be 0 or more, got {values[name]}")
    if values.get("budget_period_seconds") is not None and values["budget_period_seconds"] <= 0:
        raise ValueError(f"budget_period_seconds: must be positive, got {values['budget_period_seconds']}")
    if values.get("rate_limit"):
        try:
            parse_many(values["rate_limit"])
        except ValueError:
            raise ValueError(
                f"rate_limit: {values['rate_limit']!r} is not a rate limit such as '50/second;2000/minute'"
            ) from None


def set_policy(session: Session, tenant_name: str, values: dict) -> StoredPolicy:
    """Store `values` (some of POLICY_FIELDS; None: back to the default) for the tenant; its policy now.
    LookupError for an unknown tenant, ValueError (naming the field) for a value that cannot be stored."""
    unknown = set(values) - set(POLICY_FIELDS)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: not a policy field")
    check_values(values)
    tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant_name))
    if tenant_id is None:
        raise LookupError(f"no tenant named {tenant_name!r}")
    if "budget_period_seconds" in values and values["budget_period_seconds"] is None:
        values = {**values, "budget_period_seconds": DEFAULT_PERIOD_SECONDS}
    session.execute(
        insert(TenantPolicy)
        .values(tenant_id=tenant_id, **values)
        .on_conflict_do_update(index_elements=["tenant_id"], set_={**values, "updated_at": func.now()})
    )
    return stored_policy(session, tenant_id)


def list_policies(db: Session | Connection) -> list[tuple[uuid.UUID, str, StoredPolicy | None]]:
    """Every tenant (id, name, stored policy or None), by name."""
    rows = db.execute(
        select(Tenant.id, Tenant.name, *(getattr(TenantPolicy, name) for name in POLICY_FIELDS))
        .outerjoin(TenantPolicy, TenantPolicy.tenant_id == Tenant.id)
        .order_by(Tenant.name)
    )
    return [
        (row[0], row[1], None if row[-1] is None else StoredPolicy(*row[2:]))  # budget_period is NOT NULL
        for row in rows
    ]


def tokens_used(db: Session | Connection, tenant_id: uuid.UUID, since: datetime) -> int:
    """Tokens the tenant's jobs created since `since` use: prompt + completion, a live job its max_tokens."""
    live = Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING))
    completion = case((live, Job.max_tokens), else_=func.cardinality(Job.output_token_ids))
    return db.scalar(
        select(func.coalesce(func.sum(func.coalesce(Job.prompt_tokens, 0) + completion), 0)).where(
            Job.tenant_id == tenant_id, Job.created_at >= since
        )
    )
