"""/admin: the operator's page, server-rendered (Jinja, no front-end build). Jobs across tenants with filters
(status, priority, model, tenant), a job's timeline (its row's times and its events), cancel; tenants with their
policy (editable) and today's usage. Opened with ADMIN_KEY (empty: /admin answers 404): the login form sets a
cookie holding an HMAC of the key (HttpOnly, SameSite=Strict, so another site cannot post a cancel), or a
script sends `Authorization: Bearer <ADMIN_KEY>`."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone

from flask import Blueprint, abort, redirect, render_template, request, url_for

from jobstore.job_events import EventKind, JobEvent, job_events
from jobstore.job_search import search_jobs
from jobstore.jobs import get_job
from jobstore.models import JobStatus
from jobstore.tenant_policy import POLICY_FIELDS, Policy, list_policies, set_policy
from jobstore.usage import usage_rows
from webapi.cancels import cancel
from webapi.extensions import db, services

bp = Blueprint("admin", __name__, url_prefix="/admin", template_folder="templates")
COOKIE = "genq_admin"
STATUSES = [s.value for s in JobStatus]


def _token(key: str) -> str:
    return hmac.new(key.encode(), b"genq admin page", hashlib.sha256).hexdigest()


@bp.before_request
def require_admin():
    """404 while ADMIN_KEY is unset; the login form unless the cookie or the Bearer header holds the key."""
    key = services().settings.admin_key
    if not key:
        abort(404)
    if request.endpoint == "admin.login":
        return None
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if sent and hmac.compare_digest(sent, key):
        return None
    if hmac.compare_digest(request.cookies.get(COOKIE, ""), _token(key)):
        return None
    return redirect(url_for("admin.login", next=request.full_path))


@bp.route("/login", methods=["GET", "POST"])
def login():
    """The admin key, asked once; a cookie remembers it."""
    error = None
    if request.method == "POST":
        key = services().settings.admin_key
        if hmac.compare_digest(request.form.get("key", ""), key):
            target = request.args.get("next") or url_for("admin.jobs")
            response = redirect(target if target.startswith("/admin") else url_for("admin.jobs"))
            response.set_cookie(COOKIE, _token(key), httponly=True, samesite="Strict", path="/admin")
            return response
        error = "That is not the admin key."
    return render_template("admin/login.html", error=error), 401 if error else 200


@bp.get("")
def index():
    return redirect(url_for("admin.jobs"))


@bp.get("/jobs")
def jobs():
    """Jobs of every tenant, newest first, filtered."""
    args = request.args
    status = args.get("status") or None
    priority = args.get("priority") or None
    model = args.get("model") or None
    tenant = args.get("tenant") or None
    settings = services().settings
    default_model = settings.fleet_default_model()
    found = []
    if (status is None or status in STATUSES) and (priority is None or priority.isdigit()):
        found = search_jobs(
            db(),
            status=status and JobStatus(status),
            priority=None if priority is None else int(priority),
            tenant=tenant,
            model=model,
            default_model=default_model,
            limit=200,
        )
    tenants = [name for _, name, _ in list_policies(db())]
    return render_template(
        "admin/jobs.html",
        jobs=found,
        filters=dict(status=status, priority=priority, model=model, tenant=tenant),
        statuses=STATUSES,
        tenants=tenants,
        models=sorted(set(settings.configured_models()) | set(services().fleet.names())),
        default_model=default_model,
        now=datetime.now(timezone.utc),
    )


@bp.get("/jobs/<uuid:job_id>")
def job(job_id: uuid.UUID):
    """One job's timeline: what its row's columns and its events record."""
    found = get_job(db(), job_id)
    if found is None:
        abort(404)
    tenant = next((name for tid, name, _ in list_policies(db()) if tid == found.tenant_id), "?")
    moments, summary = timeline(found)
    return render_template(
        "admin/job.html",
        job=found,
        tenant=tenant,
        timeline=moments,
        summary=summary,
        live=not JobStatus(found.status).finished,
        model=found.model or services().settings.fleet_default_model(),
        cancelled=request.args.get("cancelled"),
    )


@bp.post("/jobs/<uuid:job_id>/cancel")
def cancel_job(job_id: uuid.UUID):
    """Cancel a queued or running job of any tenant (as its owner's cancel does)."""
    found = get_job(db(), job_id)
    if found is None:
        abort(404)
    _, cancelled = cancel(services(), job_id, found.tenant_id)
    return redirect(url_for("admin.job", job_id=job_id, cancelled="1" if cancelled else "0"))


@bp.get("/tenants")
def tenants():
    """Tenants with their policy in force and what their jobs used today (UTC)."""
    settings = services().settings
    now = datetime.now(timezone.utc)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    used: dict[uuid.UUID, dict] = defaultdict(
        lambda: {"prompt": 0, "completion": 0, "jobs": defaultdict(int)}
    )
    for row in usage_rows(db(), today, now, default_model=settings.fleet_default_model()):
        used[row.tenant_id]["prompt"] += row.prompt_tokens
        used[row.tenant_id]["completion"] += row.completion_tokens
        used[row.tenant_id]["jobs"][JobStatus(row.status).value] += row.jobs
    rows = [
        dict(
            id=tenant_id,
            name=name,
            stored=stored,
            policy=Policy.resolve(
                stored, max_queued=settings.max_queued_per_tenant, rate_limit=settings.rate_limit
            ),
            usage=used[tenant_id],
        )
        for tenant_id, name, stored in list_policies(db())
    ]
    return render_template(
        "admin/tenants.html",
        tenants=rows,
        fields=POLICY_FIELDS,
        statuses=STATUSES,
        error=request.args.get("error"),
    )


@bp.post("/tenants/<name>/policy")
def update_policy(name: str):
    """Store the form's policy for tenant `name` (an empty field: the API's default)."""
    values = {}
    for field in POLICY_FIELDS:
        text = request.form.get(field, "").strip()
        if field == "rate_limit":
            values[field] = text or None
        elif text:
            if not text.lstrip("-").isdigit():
                return redirect(url_for("admin.tenants", error=f"{name}: {field}: give a whole number"))
            values[field] = int(text)
        else:
            values[field] = None
    try:
        with services().sessions.begin() as session:
            set_policy(session, name, values)
    except (LookupError, ValueError) as exc:
        return redirect(url_for("admin.tenants", error=f"{name}: {exc}"))
    return redirect(url_for("admin.tenants"))


@dataclass(frozen=True, slots=True)
class Moment:
    """A row of a job's timeline: `kind` names it for scripts and tests (a job_events kind, or the column's)."""

    kind: str
    label: str
    at: datetime | None
    note: str


def timeline(job) -> tuple[list[Moment], str]:
    """The job's moments in the order it lived them, and a summary of its preemptions, hand-backs and re-claims.

    The times its row's columns keep (created, its last send to Redis, its first claim, its first token, its end)
    merged by time with its events (jobstore/job_events.py: re-claims, preemptions inside the engine and
    resumes, hand-backs, lease expiries); what has not happened yet comes last, without a time."""
    waited = (job.started_at - job.created_at).total_seconds() if job.started_at else None
    status = JobStatus(job.status)
    columns = [
        Moment("created", "created", job.created_at, f"priority {job.priority}"),
        Moment(
            "queued",
            "queued (sent to Redis)",
            job.enqueued_at,
            "the last send; a job handed back is sent again",
        ),
        Moment(
            "first_claim",
            "claimed",
            job.started_at,
            f"the first of {job.attempts} claim(s)"
            + (f"; by {job.worker_id}" if job.attempts == 1 and job.worker_id else "")
            + (f"; waited {waited:.2f} s" if waited is not None else ""),
        ),
        Moment("first_token", "first token", job.first_token_at, ""),
        Moment(
            "ended",
            status.value if status.finished else "finished",
            job.finished_at,
            " ".join(
                filter(None, [job.finish_reason and f"finish_reason {job.finish_reason}", job.error_code])
            ),
        ),
    ]
    found = job_events(job.events)
    recorded = [Moment(e.kind.value, _LABELS[e.kind], e.at, _note(e)) for e in found]
    # by time; at the same time (one transaction's now()), the end last
    moments = sorted(
        (m for m in columns + recorded if m.at is not None), key=lambda m: (m.at, m.kind == "ended")
    )
    preemptions = sum(e.fields.get("count", 1) for e in found if e.kind is EventKind.PREEMPTED)
    summary = (
        f"{preemptions} preemption(s) inside the engine; {job.handbacks} hand-back(s) to the queue for more "
        f"urgent work; {max(0, job.attempts - 1)} re-claim(s)"
    )
    return moments + [m for m in columns if m.at is None], summary


_LABELS = {
    EventKind.CLAIMED: "claimed again",
    EventKind.PREEMPTED: "preempted",
    EventKind.RESUMED: "resumed",
    EventKind.HANDED_BACK: "handed back",
    EventKind.LEASE_EXPIRED: "lease expired",
}
_HANDED_BACK = {
    "preempted": "to the queue, for more urgent work",
    "handed_back": "to the queue: its worker shut down",
    "rebalanced": "to the queue, for an idle worker with free slots",
    "engine_lost": "to the queue: its engine process died",
}


def _note(e: JobEvent) -> str:
    f = e.fields
    match e.kind:
        case EventKind.CLAIMED:
            return f"claim {f.get('attempt', '?')}, by {f.get('worker', '?')}"
        case EventKind.PREEMPTED:
            times = f.get("count", 1)
            return (
                "taken out of the batch for more urgent work"
                + (f" ({times} times)" if times != 1 else "")
                + "; the time of its last step before"
            )
        case EventKind.RESUMED:
            return "its first token after the preemption"
        case EventKind.HANDED_BACK:
            reason = f.get("reason", "")
            return f"{_HANDED_BACK.get(reason, reason)}; {f.get('tokens', '?')} tokens kept; by {f.get('worker', '?')}"
        case EventKind.LEASE_EXPIRED:
            return (
                f"{f.get('worker', '?')} stopped renewing its lease; the reconciler sent it back to the queue"
            )
    return ""
