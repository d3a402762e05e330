"""The calling tenant's policy (jobstore/tenant_policy.py) applied to a request: its priority cap, its /v1
default priority, its queued-job cap, its keys' rate limit and its token budget. The policy comes with the
caller's key (webapi/key_cache.py), so a change takes effect within AUTH_CACHE_SECONDS; every refusal names
the limit, and when it resets where it does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from flask import request
from sqlalchemy import func, select

from jobstore.tenant_policy import Policy, tokens_used
from webapi.auth import caller_of_key, current_tenant
from webapi.errors import APIError
from webapi.extensions import services


def tenant_policy() -> Policy:
    """The calling tenant's policy in force (the API's defaults where it has none)."""
    settings = services().settings
    return Policy.resolve(
        current_tenant().policy, max_queued=settings.max_queued_per_tenant, rate_limit=settings.rate_limit
    )


def check_priority(priority: int, field: str = "priority") -> None:
    """403 when `priority` is more urgent than the tenant's top_priority."""
    top = tenant_policy().top_priority
    if priority < top:
        raise APIError(
            403,
            "priority_not_allowed",
            f"{field}: {priority} is more urgent than this tenant's top_priority {top} allows "
            f"({top} to 9; 0 is the most urgent)",
        )


@dataclass
class TokenBudget:
    """What is left of the tenant's token budget in this period (None: no budget), spent as jobs are
    accepted in one call."""

    budget: int | None
    left: int
    resets_at: datetime | None

    def spend(self, tokens: int) -> None:
        """Take `tokens` (a job's prompt + max_tokens) from what is left; 429 naming the budget if short."""
        if self.budget is None:
            return
        if tokens > self.left:
            retry_after = max(1, math.ceil((self.resets_at - datetime.now(timezone.utc)).total_seconds()))
            raise APIError(
                429,
                "token_budget_exceeded",
                f"token_budget: {self.budget - self.left:,} of this tenant's {self.budget:,} tokens are used or "
                f"reserved this period, and this request needs up to {tokens:,}; it resets at "
                f"{self.resets_at.isoformat(timespec='seconds')}",
                {"Retry-After": str(retry_after)},
            )
        self.left -= tokens


def token_budget() -> TokenBudget:
    """The calling tenant's budget left now (a query only for a tenant that has a budget)."""
    policy = tenant_policy()
    if policy.token_budget is None:
        return TokenBudget(None, 0, None)
    with services().autocommit.connect() as conn:
        now = conn.scalar(select(func.statement_timestamp()))
        start, end = policy.budget_window(now)
        used = tokens_used(conn, current_tenant().id, start)
    return TokenBudget(policy.token_budget, policy.token_budget - used, end)


def rate_limit_of_caller() -> str:
    """Flask-Limiter's limit for this request: the RATE_LIMIT of the key's tenant (its policy's, else the
    default). The limiter runs before the view's key check, so the key is looked up here (the same cache)."""
    settings = services().settings
    scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return settings.rate_limit
    caller = caller_of_key(key.strip())
    if caller is None or caller.policy is None:
        return settings.rate_limit
    return caller.policy.rate_limit or settings.rate_limit
