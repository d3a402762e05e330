"""/metrics per tenant, read from Postgres at scrape time: genq_tenant_jobs{tenant,status} and
genq_tenant_tokens{tenant,kind} over the jobs created today (UTC). The label's values are bounded: the
USAGE_METRICS_TENANTS tenants whose jobs used the most tokens today by name, every other one summed under
tenant="other" (0 turns these metrics off)."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta, timezone

from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.orm import Session

from jobstore.models import JobStatus
from jobstore.usage import usage_rows

OTHER = "other"


def tenant_gauges(session: Session, named_tenants: int) -> list[GaugeMetricFamily]:
    if named_tenants <= 0:
        return []
    now = datetime.now(timezone.utc)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    rows = usage_rows(session, today, now + timedelta(days=1), default_model="")  # models summed here
    tokens: dict[str, int] = defaultdict(int)
    for row in rows:
        tokens[row.tenant] += row.prompt_tokens + row.completion_tokens
    named = set(sorted(tokens, key=lambda name: (-tokens[name], name))[:named_tenants])
    jobs = GaugeMetricFamily(
        "genq_tenant_jobs",
        "Jobs created today (UTC) per tenant and status, at scrape time",
        labels=["tenant", "status"],
    )
    used = GaugeMetricFamily(
        "genq_tenant_tokens",
        "Tokens of the jobs created today (UTC) per tenant, prompt or completion, at scrape time",
        labels=["tenant", "kind"],
    )
    job_counts: dict[tuple[str, str], int] = defaultdict(int)
    token_counts: dict[tuple[str, str], int] = defaultdict(int)
    for row in rows:
        label = row.tenant if row.tenant in named else OTHER
        job_counts[label, JobStatus(row.status).value] += row.jobs
        token_counts[label, "prompt"] += row.prompt_tokens
        token_counts[label, "completion"] += row.completion_tokens
    for labels, n in sorted(job_counts.items()):
        jobs.add_metric(list(labels), n)
    for labels, n in sorted(token_counts.items()):
        used.add_metric(list(labels), n)
    return [jobs, used]
