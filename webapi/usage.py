"""GET /usage: what the caller's jobs used over a period (jobstore/usage.py), and its token budget."""

from __future__ import annotations

from flask import Blueprint
from sqlalchemy import func, select

from jobstore.tenant_policy import tokens_used
from jobstore.usage import usage_rows
from webapi.auth import current_tenant, require_api_key
from webapi.errors import APIError
from webapi.extensions import services
from webapi.spec import endpoint
from webapi.tenant_limits import tenant_policy
from webapi.usage_schemas import BudgetState, ModelUsage, UsageOut, UsageQuery, UsageTotals

bp = Blueprint("usage", __name__, url_prefix="/usage")
bp.before_request(require_api_key)


@bp.get("")
@endpoint(query=UsageQuery, responses={200: UsageOut})
def get_usage(query: UsageQuery):
    """The caller's tokens and jobs by status over a period, in all and per model; its token budget."""
    tenant, policy = current_tenant(), tenant_policy()
    for name in ("since", "until"):
        value = getattr(query, name)
        if value is not None and value.tzinfo is None:
            raise APIError(
                422, "invalid_request", f"{name}: give the time's zone (e.g. 2026-11-27T00:00:00Z)"
            )
    with services().autocommit.connect() as conn:
        now = conn.scalar(select(func.statement_timestamp()))
        period_start, resets_at = policy.budget_window(now)
        since, until = query.since or period_start, query.until or now
        if until <= since:
            raise APIError(422, "invalid_request", "until: must be after since")
        rows = usage_rows(
            conn, since, until, tenant.id, default_model=services().settings.fleet_default_model()
        )
        budget = None
        if policy.token_budget is not None:
            used = tokens_used(conn, tenant.id, period_start)
            budget = BudgetState(
                budget=policy.token_budget, used=used, period_start=period_start, resets_at=resets_at
            )
    totals = UsageTotals.of(rows)
    models = sorted({row.model for row in rows})
    return UsageOut(
        tenant=tenant.name,
        since=since,
        until=until,
        prompt_tokens=totals.prompt_tokens,
        completion_tokens=totals.completion_tokens,
        jobs=totals.jobs,
        models=[
            ModelUsage(model=model, **UsageTotals.of([r for r in rows if r.model == model]).model_dump())
            for model in models
        ],
        token_budget=budget,
    ).model_dump(mode="json")
