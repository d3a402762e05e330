"""Prometheus metrics of the API: requests, submissions, and jobs waiting or running (from Postgres)."""

from __future__ import annotations

import time

from flask import Flask, g, request
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobstore.jobs import ACTIVE
from jobstore.models import Job

HTTP_REQUESTS = Counter("genq_http_requests_total", "HTTP requests answered", ["method", "endpoint", "status"])
HTTP_LATENCY = Histogram("genq_http_request_duration_seconds", "Time to answer an HTTP request", ["endpoint"])
JOBS_SUBMITTED = Counter("genq_jobs_submitted_total", "Jobs accepted and sent to the queue", ["priority"])
JOBS_ACTIVE = Gauge("genq_jobs", "Jobs queued or running, read from Postgres at scrape time", ["status"])


def init_metrics(app: Flask) -> None:
    """Time and count every request by its route (not its URL, which holds ids)."""

    @app.before_request
    def start_timer():
        g.started = time.perf_counter()

    @app.after_request
    def observe(response):
        endpoint = request.url_rule.rule if request.url_rule else "unmatched"
        HTTP_REQUESTS.labels(request.method, endpoint, str(response.status_code)).inc()
        if "started" in g:
            HTTP_LATENCY.labels(endpoint).observe(time.perf_counter() - g.started)
        return response


def refresh_job_gauges(session: Session) -> None:
    """Set genq_jobs{status} for the live states from one GROUP BY."""
    counts = dict(session.execute(
        select(Job.status, func.count()).where(Job.status.in_(ACTIVE)).group_by(Job.status)).all())
    for status in ACTIVE:
        JOBS_ACTIVE.labels(status.value).set(counts.get(status, 0))
